//! Running the built TC programs on hand-made frames with `BPF_PROG_TEST_RUN`, against maps
//! seeded by the test: the least powerful tool that proves what one program does to one packet.
//!
//! [`TcPrograms::load`] loads the same object `cargo xtask build` embeds in the agent, with its
//! maps pinned under a fresh `/sys/fs/bpf/epxt-*` directory (removed on drop) and small
//! capacities; nothing is attached anywhere.

use std::fs;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddrV4, SocketAddrV6};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use aya::maps::{HashMap, MapData, PerCpuArray};
use aya::programs::{SchedClassifier, TestRun, TestRunOptions};
use aya::{Ebpf, EbpfLoader};
use proxy_abi::{
    map_name, stat, Backend4, Backend6, BackendId, CtEntry4, CtEntry6, CtKey4, CtKey6, IfAddr4, IfAddr6, MaglevTable4,
    ServiceKey4, ServiceKey6, ServiceValue4, SCOPE_EXTERNAL,
};

/// The tc verdicts a test expects.
pub const TC_ACT_OK: u32 = 0;
pub const TC_ACT_SHOT: u32 = 2;
pub const TC_ACT_REDIRECT: u32 = 7;

pub const INGRESS: &str = "epx_tc_ingress";
pub const EGRESS: &str = "epx_tc_egress";

/// The eBPF object: `$EPX_EBPF_OBJECT`, else where `cargo xtask build` writes it.
pub fn ebpf_object() -> PathBuf {
    let path = std::env::var_os("EPX_EBPF_OBJECT").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bpf/bpfel-unknown-none/release/proxy-ebpf")
    });
    assert!(path.exists(), "{} is missing: build it with `cargo xtask build`", path.display());
    path
}

/// What one run gave back.
#[derive(Debug)]
pub struct Outcome {
    pub verdict: u32,
    pub frame: Vec<u8>,
}

/// The TC programs, loaded with their own maps.
pub struct TcPrograms {
    ebpf: Ebpf,
    pin_dir: PathBuf,
}

impl TcPrograms {
    pub fn load() -> anyhow::Result<Self> {
        Self::load_object(&ebpf_object())
    }

    /// [`TcPrograms::load`] of another build of the programs (e.g. the benchmark's build
    /// without logging).
    pub fn load_object(path: &Path) -> anyhow::Result<Self> {
        crate::require_root();
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}-{}-pkt", crate::PREFIX, crate::unique_id()));
        fs::create_dir_all(&pin_dir).with_context(|| format!("creating {}", pin_dir.display()))?;
        let object = fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let loaded = EbpfLoader::new()
            .default_map_pin_directory(&pin_dir)
            .map_max_entries(map_name::SERVICES4, 1024)
            .map_max_entries(map_name::BACKENDS4, 1024)
            .map_max_entries(map_name::REV_NAT4, 1024)
            .map_max_entries(map_name::REV_SOCK4, 1024)
            .map_max_entries(map_name::CT4, 1024)
            .map_max_entries(map_name::SERVICES6, 1024)
            .map_max_entries(map_name::BACKENDS6, 1024)
            .map_max_entries(map_name::REV_NAT6, 1024)
            .map_max_entries(map_name::REV_SOCK6, 1024)
            .map_max_entries(map_name::CT6, 1024)
            .load(&object);
        let mut ebpf = match loaded {
            Ok(ebpf) => ebpf,
            Err(e) => {
                let _ = fs::remove_dir_all(&pin_dir);
                return Err(e).context("loading the eBPF object");
            }
        };
        for name in [INGRESS, EGRESS] {
            let program: &mut SchedClassifier =
                ebpf.program_mut(name).with_context(|| format!("no program {name}"))?.try_into()?;
            // The verifier log is in the error's debug form; show it whole if the load fails.
            program.load().map_err(|e| anyhow::anyhow!("loading {name}: {e:?}"))?;
        }
        Ok(Self { ebpf, pin_dir })
    }

    /// Runs `program` on `frame` once.
    pub fn run(&self, program: &str, frame: &[u8]) -> anyhow::Result<Outcome> {
        let program: &SchedClassifier = self.ebpf.program(program).context("no such program")?.try_into()?;
        // Room for a frame that grows (the reject path builds a reply of its own size).
        let mut out = vec![0u8; frame.len().max(128) + 256];
        let result = program
            .test_run(TestRunOptions { data_in: Some(frame), data_out: Some(&mut out), ..Default::default() })
            .context("BPF_PROG_TEST_RUN")?;
        out.truncate(result.data_size_out as usize);
        Ok(Outcome { verdict: result.return_value, frame: out })
    }

    /// Runs `program` on `frame` `repeat` times in a row in the kernel: the last verdict and the
    /// mean time of one run as the kernel measured it (`BPF_PROG_TEST_RUN`'s duration, which
    /// leaves out the system call).
    pub fn time(&self, program: &str, frame: &[u8], repeat: u32) -> anyhow::Result<(u32, Duration)> {
        let program: &SchedClassifier = self.ebpf.program(program).context("no such program")?.try_into()?;
        let result =
            program.test_run(TestRunOptions { data_in: Some(frame), repeat, ..Default::default() }).context("BPF_PROG_TEST_RUN")?;
        Ok((result.return_value, result.duration))
    }

    fn hash<K: aya::Pod, V: aya::Pod>(&mut self, name: &str) -> anyhow::Result<HashMap<&mut MapData, K, V>> {
        Ok(HashMap::try_from(self.ebpf.map_mut(name).with_context(|| format!("no map {name}"))?)?)
    }

    /// Writes an external frontend (slot 0 with `flags`) and its backends (`(id, backend)`, one
    /// slot each), as the agent does.
    pub fn put_frontend(
        &mut self,
        frontend: SocketAddrV4,
        proto: u8,
        rev_nat_id: u16,
        flags: u8,
        backends: &[(BackendId, SocketAddrV4, u8)],
    ) -> anyhow::Result<()> {
        for &(id, addr, backend_flags) in backends {
            let value = Backend4 { addr_be: be_addr(&addr), port_be: addr.port().to_be(), proto, flags: backend_flags };
            self.hash::<BackendId, Backend4>(map_name::BACKENDS4)?.insert(id, value, 0)?;
        }
        let mut services = self.hash::<ServiceKey4, ServiceValue4>(map_name::SERVICES4)?;
        let key = |slot| ServiceKey4::new(be_addr(&frontend), frontend.port().to_be(), proto, SCOPE_EXTERNAL, slot);
        for (slot, &(id, _, _)) in backends.iter().enumerate() {
            services.insert(key(slot as u16 + 1), ServiceValue4 { backend_id: id, ..Default::default() }, 0)?;
        }
        let slot0 = ServiceValue4 { count: backends.len() as u16, rev_nat_id, flags, ..Default::default() };
        services.insert(key(0), slot0, 0)?;
        Ok(())
    }

    /// [`TcPrograms::put_frontend`] for IPv6.
    pub fn put_frontend6(
        &mut self,
        frontend: SocketAddrV6,
        proto: u8,
        rev_nat_id: u16,
        flags: u8,
        backends: &[(BackendId, SocketAddrV6, u8)],
    ) -> anyhow::Result<()> {
        for &(id, addr, backend_flags) in backends {
            let value = Backend6 { addr: words6(addr.ip()), port_be: addr.port().to_be(), proto, flags: backend_flags };
            self.hash::<BackendId, Backend6>(map_name::BACKENDS6)?.insert(id, value, 0)?;
        }
        let mut services = self.hash::<ServiceKey6, ServiceValue4>(map_name::SERVICES6)?;
        let key = |slot| ServiceKey6::new(words6(frontend.ip()), frontend.port().to_be(), proto, SCOPE_EXTERNAL, slot);
        for (slot, &(id, _, _)) in backends.iter().enumerate() {
            services.insert(key(slot as u16 + 1), ServiceValue4 { backend_id: id, ..Default::default() }, 0)?;
        }
        let slot0 = ServiceValue4 { count: backends.len() as u16, rev_nat_id, flags, ..Default::default() };
        services.insert(key(0), slot0, 0)?;
        Ok(())
    }

    /// Every IPv6 conntrack entry.
    pub fn conntrack6(&mut self) -> anyhow::Result<Vec<(CtKey6, CtEntry6)>> {
        let map = self.hash::<CtKey6, CtEntry6>(map_name::CT6)?;
        Ok(map.iter().collect::<Result<Vec<_>, _>>()?)
    }

    /// Records `addr` as the IPv4 address of interface `ifindex`, as the agent does when it
    /// attaches (BPF_PROG_TEST_RUN runs a program on the loopback device, ifindex 1).
    pub fn put_interface_address(&mut self, ifindex: u32, addr: Ipv4Addr) -> anyhow::Result<()> {
        let value = IfAddr4 { addr_be: u32::from(addr).to_be() };
        self.hash::<u32, IfAddr4>(map_name::IFADDR4)?.insert(ifindex, value, 0)?;
        Ok(())
    }

    /// [`TcPrograms::put_interface_address`] for IPv6.
    pub fn put_interface_address6(&mut self, ifindex: u32, addr: Ipv6Addr) -> anyhow::Result<()> {
        self.hash::<u32, IfAddr6>(map_name::IFADDR6)?.insert(ifindex, IfAddr6 { addr: words6(&addr) }, 0)?;
        Ok(())
    }

    /// Writes the Maglev table of the frontend with `rev_nat_id` (slot -> backend id).
    pub fn put_maglev(&mut self, rev_nat_id: u16, table: &[BackendId]) -> anyhow::Result<()> {
        let value = MaglevTable4 { backend_ids: table.try_into().context("a table has maglev::TABLE_SIZE slots")? };
        self.hash::<u32, MaglevTable4>(map_name::MAGLEV4)?.insert(u32::from(rev_nat_id), value, 0)?;
        Ok(())
    }

    pub fn delete_maglev(&mut self, rev_nat_id: u16) -> anyhow::Result<()> {
        self.hash::<u32, MaglevTable4>(map_name::MAGLEV4)?.remove(&u32::from(rev_nat_id))?;
        Ok(())
    }

    pub fn delete_backend(&mut self, id: BackendId) -> anyhow::Result<()> {
        self.hash::<BackendId, Backend4>(map_name::BACKENDS4)?.remove(&id)?;
        Ok(())
    }

    /// Every conntrack entry.
    pub fn conntrack(&mut self) -> anyhow::Result<Vec<(CtKey4, CtEntry4)>> {
        let map = self.hash::<CtKey4, CtEntry4>(map_name::CT4)?;
        Ok(map.iter().collect::<Result<Vec<_>, _>>()?)
    }

    /// The counter `name` (one of `proxy_abi::stat::NAMES`), summed over CPUs.
    pub fn counter(&self, name: &str) -> anyhow::Result<u64> {
        let index = stat::NAMES.iter().position(|n| *n == name).with_context(|| format!("no counter {name}"))?;
        let array: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.ebpf.map(map_name::STATS).context("no stats map")?)?;
        Ok(array.get(&(index as u32), 0)?.iter().sum())
    }
}

impl Drop for TcPrograms {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.pin_dir);
    }
}

/// An IPv6 address as the maps hold it: four words, network byte order in memory.
pub fn words6(ip: &Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    std::array::from_fn(|i| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]))
}

/// An address as the maps hold it (network byte order in memory).
pub fn be_addr(addr: &SocketAddrV4) -> u32 {
    u32::from_ne_bytes(addr.ip().octets())
}

/// The source MAC of frames the programs send on to "the other node" of [`routed_netns`], and
/// that node's MAC (their destination).
pub const NODE_LINK_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];
pub const OTHER_NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];

/// A namespace with known routing, for the packets the programs route themselves: a link
/// 192.168.250.1/24 (MAC 02:..:0a) to "the other node" 192.168.250.2 (MAC 02:..:0b, a permanent
/// neighbour), which is the next hop for that node's pods (10.244.2.0/24) and, here, for the
/// client's network too (192.168.240.0/24). Nothing else is routed.
pub fn routed_netns() -> anyhow::Result<crate::topology::Netns> {
    let ns = crate::topology::Netns::create(&format!("{}-{}-fib", crate::PREFIX, crate::unique_id()))?;
    for cmd in [
        "ip link add epxa address 02:00:00:00:00:0a type veth peer name epxb",
        "ip addr add 192.168.250.1/24 dev epxa",
        "ip link set epxa up",
        "ip link set epxb up",
        "ip neigh replace 192.168.250.2 lladdr 02:00:00:00:00:0b dev epxa nud permanent",
        "ip route add 10.244.2.0/24 via 192.168.250.2",
        "ip route add 192.168.240.0/24 via 192.168.250.2",
        "sysctl -qw net.ipv4.ip_forward=1",
    ] {
        ns.exec(&cmd.split(' ').collect::<Vec<_>>()).with_context(|| cmd.to_owned())?;
    }
    Ok(ns)
}
