//! `ebpf-proxy dump`: what the kernel is using, read from the pinned maps alone (works while the
//! agent is stopped).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use proxy_abi::{backend_flags, svc_flags};

use crate::kernel::{self, KernelMaps};
use crate::lbmap::{BackendValue, LbMaps, RevNatValue};
use crate::reconcile::{backend_flags_of, decode_backend, decode_frontend, ipv6_from_words};

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DumpedBackend {
    pub id: u32,
    pub ip: String,
    pub port: u16,
    /// The endpoint runs on this node.
    pub local: bool,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DumpedService {
    pub ip: String,
    pub port: u16,
    pub protocol: String,
    pub scope: String,
    /// ClusterIP, NodePort, ExternalIP or LoadBalancer.
    pub kind: String,
    /// Only node-local backends (a `Local` traffic policy).
    pub local_only: bool,
    /// ClientIP session affinity timeout, when affinity is on.
    pub affinity_timeout_seconds: Option<u32>,
    pub rev_nat_id: u16,
    pub backends: Vec<DumpedBackend>,
    /// `--lb-algorithm maglev`: slots of the frontend's table per backend (`ip:port`), or
    /// `{"(table missing)": 0}` if slot 0 is marked but the table is not there.
    pub maglev_slots: Option<BTreeMap<String, u32>>,
}

/// The frontend kind a slot-0 flag set encodes.
fn kind_name(flags: u8) -> &'static str {
    if flags & svc_flags::NODE_PORT != 0 {
        "NodePort"
    } else if flags & svc_flags::EXTERNAL_IP != 0 {
        "ExternalIP"
    } else if flags & svc_flags::LOAD_BALANCER != 0 {
        "LoadBalancer"
    } else {
        "ClusterIP"
    }
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Dump {
    pub services: Vec<DumpedService>,
    pub counters: BTreeMap<String, u64>,
    pub rev_sock_entries: usize,
    /// Flows the packet-level datapath translated (one line per flow, from its forward entry).
    pub conntrack: Vec<DumpedFlow>,
    /// Session-affinity entries: which client was last sent to which backend of a frontend.
    pub affinity: Vec<DumpedAffinity>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DumpedAffinity {
    /// `netns:COOKIE` (a local client: pod or node, socket hooks), or the client's IPv4 or IPv6
    /// address (packet path).
    pub client: String,
    /// `ip:port` of the frontend (from the reverse-NAT map), or `rev-nat:ID` if it is gone.
    pub frontend: String,
    pub rev_nat_id: u16,
    pub backend: String,
    pub backend_id: u32,
    pub idle_seconds: u64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DumpedFlow {
    pub protocol: String,
    pub client: String,
    pub frontend: String,
    pub backend: String,
    pub backend_id: u32,
    pub rev_nat_id: u16,
    /// TCP state seen so far: `syn`, `established`, `closing` (FIN or RST); empty for UDP.
    pub tcp_state: String,
    pub idle_seconds: u64,
    /// Past its timeout: the kernel treats it as gone, and the agent's garbage collection
    /// deletes it within `--conntrack-gc-interval`.
    pub expired: bool,
    /// TCP: the client's next sequence number as conntrack last saw it (0 before it knows);
    /// a RST from the client counts only near it.
    pub client_seq_next: u32,
    /// `ip:port` the flow leaves the node from when it is SNATed (backend on another node).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat: Option<String>,
}

/// What `dump` shows of one conntrack entry of either family.
struct FlowView {
    forward: bool,
    proto: u8,
    client: String,
    frontend: String,
    backend: String,
    backend_id: u32,
    rev_nat_id: u16,
    state: proxy_abi::CtState,
    snat: Option<String>,
}

fn flows6(entries: Vec<(proxy_abi::CtKey6, proxy_abi::CtEntry6)>) -> Vec<FlowView> {
    let addr = |a: [u32; 4], p: u16| SocketAddr::new(ipv6_from_words(a).into(), u16::from_be(p)).to_string();
    entries
        .into_iter()
        .map(|(key, entry)| FlowView {
            forward: key.dir == proxy_abi::ct::DIR_FORWARD,
            proto: key.proto,
            client: addr(key.saddr, key.sport_be),
            frontend: addr(entry.frontend_addr, entry.frontend_port_be),
            backend: addr(entry.backend_addr, entry.backend_port_be),
            backend_id: entry.backend_id,
            rev_nat_id: entry.rev_nat_id,
            state: entry.state,
            snat: (entry.nat & proxy_abi::ct::NAT_SNAT != 0).then(|| addr(entry.snat_addr, entry.snat_port_be)),
        })
        .collect()
}

fn flows4(entries: Vec<(proxy_abi::CtKey4, proxy_abi::CtEntry4)>) -> Vec<FlowView> {
    use std::net::SocketAddrV4;
    let addr = |a: u32, p: u16| SocketAddrV4::new(Ipv4Addr::from(u32::from_be(a)), u16::from_be(p)).to_string();
    entries
        .into_iter()
        .map(|(key, entry)| FlowView {
            forward: key.dir == proxy_abi::ct::DIR_FORWARD,
            proto: key.proto,
            client: addr(key.saddr_be, key.sport_be),
            frontend: addr(entry.frontend_addr_be, entry.frontend_port_be),
            backend: addr(entry.backend_addr_be, entry.backend_port_be),
            backend_id: entry.backend_id,
            rev_nat_id: entry.rev_nat_id,
            state: entry.state,
            snat: (entry.nat & proxy_abi::ct::NAT_SNAT != 0).then(|| addr(entry.snat_addr_be, entry.snat_port_be)),
        })
        .collect()
}

fn flows(entries: Vec<FlowView>) -> Vec<DumpedFlow> {
    use proxy_abi::ct;
    let now_ns = monotonic_now_ns();
    let mut flows: Vec<DumpedFlow> = entries
        .into_iter()
        .filter(|view| view.forward)
        .map(|view| DumpedFlow {
            protocol: match view.proto {
                proxy_abi::IPPROTO_TCP => "TCP".into(),
                proxy_abi::IPPROTO_UDP => "UDP".into(),
                other => other.to_string(),
            },
            client: view.client,
            frontend: view.frontend,
            backend: view.backend,
            backend_id: view.backend_id,
            rev_nat_id: view.rev_nat_id,
            tcp_state: if view.proto != proxy_abi::IPPROTO_TCP {
                String::new()
            } else if view.state.tcp_seen & (ct::TCP_FIN | ct::TCP_RST) != 0 {
                "closing".into()
            } else if view.state.tcp_seen & ct::TCP_ESTABLISHED != 0 {
                "established".into()
            } else {
                "syn".into()
            },
            idle_seconds: now_ns.saturating_sub(view.state.last_seen_ns) / 1_000_000_000,
            expired: ct::is_expired(&view.state, view.proto, now_ns),
            client_seq_next: view.state.seq_next,
            snat: view.snat,
        })
        .collect();
    flows.sort_by(|a, b| (&a.frontend, &a.client).cmp(&(&b.frontend, &b.client)));
    flows
}

/// CLOCK_MONOTONIC in nanoseconds: the clock the kernel side stamps entries with.
pub fn monotonic_now_ns() -> u64 {
    // SAFETY: clock_gettime with a valid out-parameter.
    unsafe {
        let mut ts: libc::timespec = std::mem::zeroed();
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    }
}

/// `ip:port` of a reverse-NAT entry (`[ip6]:port` for IPv6).
fn rev_nat_text(value: &RevNatValue) -> String {
    match value {
        RevNatValue::V4(r) => SocketAddr::new(Ipv4Addr::from(u32::from_be(r.addr_be)).into(), u16::from_be(r.port_be)),
        RevNatValue::V6(r) => SocketAddr::new(ipv6_from_words(r.addr).into(), u16::from_be(r.port_be)),
    }
    .to_string()
}

/// `ip:port` of a backend entry (`[ip6]:port` for IPv6).
fn backend_text(value: &BackendValue) -> String {
    decode_backend(value).map_or_else(|| "(undecodable)".to_owned(), |b| SocketAddr::new(b.addr, b.port).to_string())
}

fn affinity_entries(
    entries: Vec<(proxy_abi::AffinityKey4, proxy_abi::AffinityValue4)>,
    rev_nats: &BTreeMap<u16, RevNatValue>,
    backends: &BTreeMap<u32, BackendValue>,
) -> Vec<DumpedAffinity> {
    let now_ns = monotonic_now_ns();
    let mut dumped: Vec<DumpedAffinity> = entries
        .into_iter()
        .map(|(key, value)| DumpedAffinity {
            client: match key.kind {
                proxy_abi::affinity::CLIENT_IP4 => Ipv4Addr::from(u32::from_be(key.client[0])).to_string(),
                proxy_abi::affinity::CLIENT_IP6 => ipv6_from_words(key.client).to_string(),
                _ => format!("netns:{}", proxy_abi::affinity::netns_cookie(&key.client)),
            },
            frontend: rev_nats.get(&key.rev_nat_id).map_or_else(|| format!("rev-nat:{}", key.rev_nat_id), rev_nat_text),
            rev_nat_id: key.rev_nat_id,
            backend: backends.get(&value.backend_id).map_or_else(|| "(gone)".to_owned(), backend_text),
            backend_id: value.backend_id,
            idle_seconds: now_ns.saturating_sub(value.last_used_ns) / 1_000_000_000,
        })
        .collect();
    dumped.sort_by(|a, b| (&a.frontend, &a.client).cmp(&(&b.frontend, &b.client)));
    dumped
}

/// How many slots of a Maglev table each backend has.
fn maglev_shares(table: Option<&Vec<u32>>, backends: &BTreeMap<u32, BackendValue>) -> BTreeMap<String, u32> {
    let Some(table) = table else { return BTreeMap::from([("(table missing)".to_owned(), 0)]) };
    let mut shares = BTreeMap::new();
    for id in table {
        let name = backends.get(id).map_or_else(|| format!("(backend {id} gone)"), backend_text);
        *shares.entry(name).or_default() += 1;
    }
    shares
}

pub fn collect(bpffs: &Path) -> anyhow::Result<Dump> {
    let maps = KernelMaps::open_pinned(bpffs)
        .with_context(|| format!("no datapath pinned under {} (is the agent installed there?)", bpffs.display()))?;
    let entries: BTreeMap<_, _> = maps.services()?.into_iter().collect();
    let backends: BTreeMap<_, _> = maps.backends()?.into_iter().collect();
    let tables: BTreeMap<_, _> = maps.maglev_tables()?.into_iter().collect();
    let mut services = Vec::new();
    for (key, value) in entries.iter().filter(|(k, _)| k.slot() == 0) {
        let Some(frontend) = decode_frontend(key) else { continue };
        let mut dumped = Vec::new();
        for slot in 1..=value.count {
            let Some(slot_value) = entries.get(&key.with_slot(slot)) else { continue };
            let id = slot_value.backend_id;
            let Some(entry) = backends.get(&id) else { continue };
            if let Some(backend) = decode_backend(entry) {
                let local = backend_flags_of(entry) & backend_flags::LOCAL != 0;
                dumped.push(DumpedBackend { id, ip: backend.addr.to_string(), port: backend.port, local });
            }
        }
        services.push(DumpedService {
            ip: frontend.addr.to_string(),
            port: frontend.port,
            protocol: frontend.proto.to_string(),
            scope: frontend.scope.name().to_owned(),
            kind: kind_name(value.flags).to_owned(),
            local_only: value.flags & svc_flags::LOCAL_ONLY != 0,
            affinity_timeout_seconds: (value.flags & svc_flags::AFFINITY != 0).then_some(value.backend_id),
            rev_nat_id: value.rev_nat_id,
            backends: dumped,
            maglev_slots: (value.flags & svc_flags::MAGLEV != 0).then(|| maglev_shares(tables.get(&value.rev_nat_id), &backends)),
        });
    }
    let flow_maps = kernel::FlowMaps::open_pinned(bpffs)?;
    let counters = flow_maps
        .counters()?
        .into_iter()
        .zip(proxy_abi::stat::NAMES)
        .map(|(value, name)| (name.to_owned(), value))
        .collect();
    let rev_sock_entries = flow_maps.rev_sock_entries();
    let mut views = flows4(flow_maps.conntrack_entries4());
    views.extend(flows6(flow_maps.conntrack_entries6()));
    let conntrack = flows(views);
    let rev_nats: BTreeMap<_, _> = maps.rev_nats()?.into_iter().collect();
    let affinity = affinity_entries(flow_maps.affinity_entries(), &rev_nats, &backends);
    Ok(Dump {
        services,
        counters,
        rev_sock_entries,
        conntrack,
        affinity,
    })
}

pub fn print_text(dump: &Dump) {
    println!("{:<28} {:<8} {:<12} {:<24} {:>7}  BACKENDS", "FRONTEND", "SCOPE", "KIND", "FLAGS", "REV-NAT");
    for service in &dump.services {
        let frontend = format!("{}:{}/{}", service.ip, service.port, service.protocol);
        let mut flags = Vec::new();
        if service.local_only {
            flags.push("local-only".to_owned());
        }
        if let Some(timeout) = service.affinity_timeout_seconds {
            flags.push(format!("affinity={timeout}s"));
        }
        if service.maglev_slots.is_some() {
            flags.push("maglev".to_owned());
        }
        let flags = if flags.is_empty() { "-".to_owned() } else { flags.join(",") };
        let backends = if service.backends.is_empty() {
            if service.local_only {
                "(none on this node: dropped)".to_owned()
            } else {
                "(none: connections are refused)".to_owned()
            }
        } else {
            let backend = |b: &DumpedBackend| format!("{}:{}{}", b.ip, b.port, if b.local { " (local)" } else { "" });
            service.backends.iter().map(backend).collect::<Vec<_>>().join(", ")
        };
        println!(
            "{frontend:<28} {:<8} {:<12} {flags:<24} {:>7}  {backends}",
            service.scope, service.kind, service.rev_nat_id
        );
    }
    for service in dump.services.iter().filter(|s| s.maglev_slots.is_some()) {
        let shares = service.maglev_slots.iter().flatten().map(|(b, n)| format!("{b}={n}")).collect::<Vec<_>>();
        println!("  maglev {}:{}/{}: {}", service.ip, service.port, service.protocol, shares.join(" "));
    }
    println!();
    println!("counters:");
    for (name, value) in &dump.counters {
        println!("  {name:<22} {value}");
    }
    println!("socket reverse-translation entries: {}", dump.rev_sock_entries);
    println!();
    println!("connection tracking ({} flows):", dump.conntrack.len());
    for flow in &dump.conntrack {
        println!(
            "  {:<4} {:<22} -> {:<22} -> {:<22} {:<12} idle {}s",
            flow.protocol, flow.client, flow.frontend, flow.backend, flow.tcp_state, flow.idle_seconds
        );
    }
    println!();
    println!("session affinity ({} entries):", dump.affinity.len());
    for entry in &dump.affinity {
        println!("  {:<22} -> {:<22} -> {:<22} idle {}s", entry.client, entry.frontend, entry.backend, entry.idle_seconds);
    }
}
