//! The contract between the kernel programs and the agent: map names, keys, values and constants.
//!
//! Defined once and used by both sides. Every type is `#[repr(C)]` with explicit padding and a
//! compile-time size assertion; fields holding network byte order end in `_be`. A layout change
//! means a new map name (the `_vN` suffix), never a silent reinterpretation of a pinned map.
#![no_std]

use core::mem::size_of;

/// Map names. They double as pin file names under the agent's bpffs directory, so they must stay
/// below the kernel's 16-byte object-name limit (15 characters plus NUL).
pub mod map_name {
    pub const SERVICES4: &str = "epx_svc4_v1";
    pub const BACKENDS4: &str = "epx_be4_v1";
    pub const REV_NAT4: &str = "epx_revnat4_v1";
    pub const REV_SOCK4: &str = "epx_revsk4_v1";
    /// v2: 64 slots (v1 had exactly as many as counters, so every new counter broke upgrades).
    pub const STATS: &str = "epx_stats_v2";
    /// v2: the flow's state (`CtState`: last packet, TCP state, next sequence number) in both
    /// entries of a flow.
    pub const CT4: &str = "epx_ct4_v2";
    pub const IFADDR4: &str = "epx_ifaddr4_v1";
    /// v2: the client in 128 bits (v1 folded an IPv6 client to 64, so clients that folded alike
    /// shared their backend).
    pub const AFFINITY4: &str = "epx_aff4_v2";
    pub const MAGLEV4: &str = "epx_maglev4_v1";
    pub const SERVICES6: &str = "epx_svc6_v1";
    pub const BACKENDS6: &str = "epx_be6_v1";
    pub const REV_NAT6: &str = "epx_revnat6_v1";
    pub const REV_SOCK6: &str = "epx_revsk6_v1";
    pub const CT6: &str = "epx_ct6_v2";
    pub const IFADDR6: &str = "epx_ifaddr6_v1";
    /// The agent's settings for the kernel programs (`DatapathConfig`, one entry).
    pub const CONFIG: &str = "epx_cfg_v1";
    /// LRU: the translation of a fragmented datagram's first fragment, for the later ones.
    pub const FRAG4: &str = "epx_frag4_v1";
    pub const FRAG6: &str = "epx_frag6_v1";
    /// LRU: the backend an unconnected UDP socket's datagrams to a frontend go to (`sendmsg`).
    pub const SOCK_FLOW4: &str = "epx_sflow4_v1";
    pub const SOCK_FLOW6: &str = "epx_sflow6_v1";

    /// Every map the agent owns, in the order `dump` prints them.
    pub const ALL: [&str; 20] = [
        SERVICES4, BACKENDS4, REV_NAT4, REV_SOCK4, STATS, CT4, IFADDR4, AFFINITY4, MAGLEV4, SERVICES6, BACKENDS6,
        REV_NAT6, REV_SOCK6, CT6, IFADDR6, CONFIG, FRAG4, FRAG6, SOCK_FLOW4, SOCK_FLOW6,
    ];

    /// Pins of earlier layouts that no program of this build uses: the agent unpins them once
    /// its programs are attached (they held preallocated memory and nothing else).
    pub const OBSOLETE: [&str; 4] = ["epx_stats_v1", "epx_ct4_v1", "epx_ct6_v1", "epx_aff4_v1"];
}

/// Default capacities; the agent can override each one at load time.
pub mod capacity {
    /// Frontends × (1 + backends per frontend).
    pub const SERVICES4: u32 = 65_536;
    pub const BACKENDS4: u32 = 65_536;
    /// One entry per frontend; ids are `u16`.
    pub const REV_NAT4: u32 = 65_535;
    /// LRU: one entry per (socket, backend) that a local client connected or sent to.
    pub const REV_SOCK4: u32 = 262_144;
    /// LRU: two entries (forward and reply) per flow translated by the packet-level datapath.
    pub const CT4: u32 = 262_144;
    /// One entry per interface the packet-level programs are attached to.
    pub const IFADDR4: u32 = 1_024;
    /// LRU: one entry per (client, frontend with `sessionAffinity: ClientIP`).
    pub const AFFINITY4: u32 = 65_536;
    /// One Maglev table per external frontend (`--lb-algorithm maglev` only). Not preallocated:
    /// a table takes its memory (`maglev::TABLE_SIZE` × 4 bytes) only once written.
    pub const MAGLEV4: u32 = 16_384;
    /// The IPv6 service, backend and reverse-NAT maps: as their IPv4 counterparts (one
    /// `--map-size-*` flag sizes both families; hash maps take memory only for what they hold).
    pub const SERVICES6: u32 = SERVICES4;
    pub const BACKENDS6: u32 = BACKENDS4;
    pub const REV_NAT6: u32 = REV_NAT4;
    /// The IPv6 LRUs are preallocated and their entries are larger, so they have their own,
    /// smaller defaults (`--map-size-rev-sock6`, `--map-size-ct6`).
    pub const REV_SOCK6: u32 = 65_536;
    pub const CT6: u32 = 65_536;
    pub const IFADDR6: u32 = IFADDR4;
    /// LRU: one entry per fragmented datagram in flight (only its first fragment's lifetime
    /// matters: the later ones follow within milliseconds).
    pub const FRAG4: u32 = 16_384;
    pub const FRAG6: u32 = 16_384;
    /// LRU: one entry per (unconnected UDP socket, frontend) that sent within the idle timeout
    /// (`sock_flow::IDLE_NS`); a client evicted early picks a backend again, nothing worse.
    pub const SOCK_FLOW4: u32 = 65_536;
    pub const SOCK_FLOW6: u32 = 16_384;
}

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;

/// `ServiceKey4::scope` values. External and internal entries differ only when a traffic policy
/// makes them differ (issue: traffic policies); the socket hooks use `SCOPE_INTERNAL`.
pub const SCOPE_EXTERNAL: u8 = 0;
pub const SCOPE_INTERNAL: u8 = 1;

/// `ServiceValue4::flags` bits (slot 0 only).
pub mod svc_flags {
    /// ClientIP session affinity is on; the timeout is in `backend_id` of slot 0.
    pub const AFFINITY: u8 = 1 << 0;
    /// The frontend is a NodePort on one of the node's addresses.
    pub const NODE_PORT: u8 = 1 << 1;
    /// The frontend is one of the Service's `spec.externalIPs`.
    pub const EXTERNAL_IP: u8 = 1 << 2;
    /// The frontend is one of the Service's `status.loadBalancer.ingress` IPs.
    pub const LOAD_BALANCER: u8 = 1 << 3;
    /// A traffic policy (`externalTrafficPolicy`/`internalTrafficPolicy: Local`) limits this
    /// entry to node-local backends: the client's source address must be preserved (no SNAT).
    pub const LOCAL_ONLY: u8 = 1 << 4;
    /// New flows from outside pick their backend from this frontend's Maglev table
    /// (`epx_maglev4_v1`, keyed by `rev_nat_id`) instead of a random slot.
    pub const MAGLEV: u8 = 1 << 5;
}

/// `Backend4::flags` bits.
pub mod backend_flags {
    /// The endpoint runs on this node (`nodeName` equals the agent's node): no SNAT needed.
    pub const LOCAL: u8 = 1 << 0;
}

/// Key of the service map. Slot 0 is the frontend itself; slots `1..=count` name backends.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey4 {
    pub addr_be: u32,
    pub port_be: u16,
    pub backend_slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<ServiceKey4>() == 12);

impl ServiceKey4 {
    pub const fn new(addr_be: u32, port_be: u16, proto: u8, scope: u8, backend_slot: u16) -> Self {
        Self { addr_be, port_be, backend_slot, proto, scope, pad: [0; 2] }
    }
}

/// Value of the service map. In slot 0: `count` usable backends and the frontend's `rev_nat_id`
/// (`backend_id` carries the affinity timeout in seconds when `svc_flags::AFFINITY` is set).
/// In slot N: `backend_id` is the backend chosen by that slot; the other fields are zero.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ServiceValue4 {
    pub backend_id: u32,
    pub count: u16,
    pub rev_nat_id: u16,
    pub flags: u8,
    pub flags2: u8,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<ServiceValue4>() == 12);

/// Backend map key.
pub type BackendId = u32;

/// Value of the backend map.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Backend4 {
    pub addr_be: u32,
    pub port_be: u16,
    pub proto: u8,
    pub flags: u8,
}
const _: () = assert!(size_of::<Backend4>() == 8);

/// Reverse-NAT map key: the frontend's id.
pub type RevNatId = u16;

/// Value of the reverse-NAT map: the frontend a translated flow must appear to come from.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNat4 {
    pub addr_be: u32,
    pub port_be: u16,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<RevNat4>() == 8);

/// Key of the socket reverse-translation LRU: which backend a given socket was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevSockKey4 {
    pub cookie: u64,
    pub addr_be: u32,
    pub port_be: u16,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<RevSockKey4>() == 16);

/// Value of the socket reverse-translation LRU: the frontend the application asked for.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevSock4 {
    pub addr_be: u32,
    pub port_be: u16,
    pub rev_nat_id: u16,
}
const _: () = assert!(size_of::<RevSock4>() == 8);

/// Key of the IPv6 service map (`epx_svc6_v1`): as [`ServiceKey4`] with a 128-bit address. Its
/// value is a [`ServiceValue4`] (the layout does not depend on the family; backend ids and
/// reverse-NAT ids are shared by both families).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey6 {
    /// The address in network byte order, as `bpf_sock_addr::user_ip6`.
    pub addr: [u32; 4],
    pub port_be: u16,
    pub backend_slot: u16,
    pub proto: u8,
    pub scope: u8,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<ServiceKey6>() == 24);

impl ServiceKey6 {
    pub const fn new(addr: [u32; 4], port_be: u16, proto: u8, scope: u8, backend_slot: u16) -> Self {
        Self { addr, port_be, backend_slot, proto, scope, pad: [0; 2] }
    }
}

/// Value of the IPv6 backend map (`epx_be6_v1`), keyed by a [`BackendId`] from the same id space
/// as the IPv4 backends.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Backend6 {
    pub addr: [u32; 4],
    pub port_be: u16,
    pub proto: u8,
    pub flags: u8,
}
const _: () = assert!(size_of::<Backend6>() == 20);

/// Value of the IPv6 reverse-NAT map (`epx_revnat6_v1`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevNat6 {
    pub addr: [u32; 4],
    pub port_be: u16,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<RevNat6>() == 20);

/// Key of the IPv6 socket reverse-translation LRU (`epx_revsk6_v1`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevSockKey6 {
    pub cookie: u64,
    pub addr: [u32; 4],
    pub port_be: u16,
    pub pad: [u8; 6],
}
const _: () = assert!(size_of::<RevSockKey6>() == 32);

/// Value of the IPv6 socket reverse-translation LRU.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RevSock6 {
    pub addr: [u32; 4],
    pub port_be: u16,
    pub rev_nat_id: u16,
}
const _: () = assert!(size_of::<RevSock6>() == 20);

/// Unconnected UDP (`sendmsg`) stickiness: a socket keeps sending one frontend's datagrams to the
/// backend it first got, as kube-proxy keeps a UDP 5-tuple on its conntrack entry's backend.
pub mod sock_flow {
    /// Idle time after which a socket's next datagram to the frontend picks a backend again: the
    /// packet path's UDP conntrack timeout (netfilter: 30 s unreplied, 120 s for a stream).
    pub const IDLE_NS: u64 = super::ct::TIMEOUT_NON_TCP_NS;
    /// `SockFlow::last_used_ns` is rewritten only when this much older than the datagram, so a
    /// busy socket does not write the map on every `sendmsg`.
    pub const REFRESH_NS: u64 = super::ct::REFRESH_NS;

    /// Whether an entry last refreshed at `last_used_ns` is past the idle timeout at `now_ns`
    /// (saturating: another CPU may have refreshed it after `now_ns` was read).
    pub const fn is_idle(last_used_ns: u64, now_ns: u64) -> bool {
        now_ns.saturating_sub(last_used_ns) > IDLE_NS + REFRESH_NS
    }
}

/// Key of the IPv4 unconnected-UDP stickiness LRU (`epx_sflow4_v1`): a socket and a frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockFlowKey4 {
    pub cookie: u64,
    pub addr_be: u32,
    pub port_be: u16,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<SockFlowKey4>() == 16);

/// Key of the IPv6 unconnected-UDP stickiness LRU (`epx_sflow6_v1`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockFlowKey6 {
    pub cookie: u64,
    pub addr: [u32; 4],
    pub port_be: u16,
    pub pad: [u8; 6],
}
const _: () = assert!(size_of::<SockFlowKey6>() == 32);

/// Value of both stickiness LRUs: the backend, the frontend it was chosen for (an entry of a
/// frontend since recreated with another reverse-NAT id is ignored), and the last use. The
/// agent deletes entries whose backend left the frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct SockFlow {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC), refreshed at most every `sock_flow::REFRESH_NS`.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub rev_nat_id: u16,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<SockFlow>() == 16);

/// Indices of the per-CPU counters array: one per verdict of the socket hooks.
pub mod stat {
    /// connect/sendmsg to a frontend translated to a backend.
    pub const SOCK_XLATE: u32 = 0;
    /// connect/sendmsg to a frontend with no usable backend: refused with ECONNREFUSED.
    pub const SOCK_NO_BACKEND: u32 = 1;
    /// A slot or backend entry was missing (agent mid-update or map damaged): refused.
    pub const SOCK_LOOKUP_MISS: u32 = 2;
    /// recvmsg/getpeername answers rewritten back to the frontend.
    pub const SOCK_REV_XLATE: u32 = 3;
    /// Failed to record the reverse translation (LRU update failed).
    pub const SOCK_REV_RECORD_FAIL: u32 = 4;
    /// TC ingress: a packet to an external frontend was DNATed to a backend.
    pub const TC_DNAT: u32 = 5;
    /// TC ingress: the packet belonged to a tracked flow and kept that flow's backend.
    pub const TC_CT_HIT: u32 = 6;
    /// TC ingress: a new flow was tracked (first packet, or the old entry timed out).
    pub const TC_CT_NEW: u32 = 7;
    /// TC egress: a reply of a tracked flow was translated back to the frontend.
    pub const TC_REV_NAT: u32 = 8;
    /// TC ingress: a packet to a frontend without backends was answered with ICMP port
    /// unreachable (as kube-proxy's REJECT; a TCP connect() fails with ECONNREFUSED).
    pub const TC_NO_BACKEND_REJECT: u32 = 9;
    /// TC ingress: a packet to a frontend without backends was dropped because no reply could be
    /// built (IP options, or a helper failed).
    pub const TC_NO_BACKEND_DROP: u32 = 10;
    /// TC ingress: a slot or backend entry was missing (agent mid-update): dropped.
    pub const TC_LOOKUP_MISS: u32 = 11;
    /// TC ingress: the conntrack entry could not be written (the packet is still translated).
    pub const TC_CT_RECORD_FAIL: u32 = 12;
    /// A truncated or inconsistent IPv4/TCP/UDP header: passed untouched.
    pub const TC_BAD_HEADER: u32 = 13;
    /// A later fragment (no ports) of a datagram whose first fragment was not translated here
    /// (not ours, or it has not arrived): passed untouched.
    pub const TC_FRAGMENT: u32 = 14;
    /// A rewrite or checksum helper failed: the packet was dropped rather than sent half-rewritten.
    pub const TC_REWRITE_FAIL: u32 = 15;
    /// TC ingress: the backend is on another node and the frontend allows SNAT, but it is an
    /// externalIP or LoadBalancer IP and the interface it arrived on has no IPv4 address in
    /// `epx_ifaddr4_v1`: DNAT only, so replies must come back through this node.
    pub const TC_REMOTE_BACKEND_NO_SNAT: u32 = 16;
    /// TC ingress: a packet for a backend on another node was also SNATed to a node address (the
    /// NodePort's, or that of the interface it arrived on) and sent towards that node.
    pub const TC_SNAT: u32 = 17;
    /// TC ingress: a reply to an SNATed flow came back and was sent on to the client.
    pub const TC_SNAT_REPLY: u32 = 18;
    /// TC ingress: every SNAT source port of the range is held by a live flow to that backend
    /// (the whole range was searched): dropped.
    pub const TC_SNAT_NO_PORT: u32 = 19;
    /// The route lookup for a packet the program must forward itself failed: dropped.
    pub const TC_FIB_FAIL: u32 = 20;
    /// TC ingress: an ICMP error about a translated flow (e.g. "fragmentation needed") was
    /// translated, outer and quoted headers, and sent on to the backend or the client.
    pub const TC_ICMP_ERROR_XLATE: u32 = 21;
    /// A frontend with session affinity sent the client to the backend it used before.
    pub const AFFINITY_HIT: u32 = 22;
    /// The affinity entry could not be written (the connection still went through).
    pub const AFFINITY_RECORD_FAIL: u32 = 23;
    /// TC ingress: a new flow's backend was picked from the frontend's Maglev table.
    pub const TC_MAGLEV_PICK: u32 = 24;
    /// TC ingress: the frontend is marked for Maglev but its table or the slot's backend was
    /// missing (agent mid-update): a random slot was used instead.
    pub const TC_MAGLEV_MISS: u32 = 25;
    /// TC ingress: the port search met a conntrack entry past its timeout and deleted it (its
    /// port is free again).
    pub const TC_CT_EXPIRED_REMOVED: u32 = 26;
    /// A TCP RST whose sequence number is outside the sender's window: passed on (the endpoint
    /// judges it too), but the tracked flow is not closed by it.
    pub const TC_RST_OUT_OF_WINDOW: u32 = 27;
    /// TC ingress: a SYN reused the tuple of a closed flow and got a fresh backend pick.
    pub const TC_CT_REOPENED: u32 = 28;
    /// A later fragment got the translation of its datagram's first fragment.
    pub const TC_FRAGMENT_XLATE: u32 = 29;
    /// sendmsg on an unconnected UDP socket kept the backend its earlier datagrams went to.
    pub const SOCK_FLOW_HIT: u32 = 30;
    /// The stickiness entry of an unconnected UDP socket could not be written (the datagram
    /// still went out; the next one may pick another backend).
    pub const SOCK_FLOW_RECORD_FAIL: u32 = 31;
    /// TC: a packet the program sends on itself (SNAT, or the reply of an SNATed flow) was
    /// larger than the MTU of the link its route leaves by, and was answered with ICMP
    /// "fragmentation needed" (DF set) or ICMPv6 "packet too big" to its sender.
    pub const TC_FRAG_NEEDED: u32 = 32;
    /// TC: such a packet could not be answered (IPv4 without DF, which nothing here fragments;
    /// IP options or IPv6 extension headers): dropped.
    pub const TC_TOO_BIG_DROP: u32 = 33;
    pub const COUNT: u32 = 34;
    /// Slots of the stats map: more than `COUNT`, so that a new counter does not change the
    /// pinned map's layout (an upgrade keeps the map and its counts).
    pub const SLOTS: u32 = 64;
    const _: () = assert!(COUNT <= SLOTS);

    pub const NAMES: [&str; COUNT as usize] = [
        "sock_xlate",
        "sock_no_backend",
        "sock_lookup_miss",
        "sock_rev_xlate",
        "sock_rev_record_fail",
        "tc_dnat",
        "tc_ct_hit",
        "tc_ct_new",
        "tc_rev_nat",
        "tc_no_backend_reject",
        "tc_no_backend_drop",
        "tc_lookup_miss",
        "tc_ct_record_fail",
        "tc_bad_header",
        "tc_fragment",
        "tc_rewrite_fail",
        "tc_remote_backend_no_snat",
        "tc_snat",
        "tc_snat_reply",
        "tc_snat_no_port",
        "tc_fib_fail",
        "tc_icmp_error_xlate",
        "affinity_hit",
        "affinity_record_fail",
        "tc_maglev_pick",
        "tc_maglev_miss",
        "tc_ct_expired_removed",
        "tc_rst_out_of_window",
        "tc_ct_reopened",
        "tc_fragment_xlate",
        "sock_flow_hit",
        "sock_flow_record_fail",
        "tc_frag_needed",
        "tc_too_big_drop",
    ];
}

/// Connection tracking of the packet-level datapath (TC programs).
pub mod ct {
    /// `CtKey4::dir`: the tuple as the request arrived (client -> frontend).
    pub const DIR_FORWARD: u8 = 0;
    /// `CtKey4::dir`: the tuple as the reply leaves (backend -> client).
    pub const DIR_REPLY: u8 = 1;

    /// `CtEntry4::nat` bits.
    pub const NAT_DNAT: u8 = 1 << 0;
    /// The source was also rewritten to `snat_addr_be:snat_port_be` (backend on another node);
    /// the reply entry is then keyed backend -> node address:SNAT port.
    pub const NAT_SNAT: u8 = 1 << 1;

    /// The default SNAT source ports: 1024-65535 without the node's ephemeral range (the
    /// agent skips the `net.ipv4.ip_local_port_range` it reads, by default 32768-60999), so that
    /// no SNATed flow takes the tuple of one of the node's own connections, and without the
    /// NodePort range (`--service-node-port-range`, by default 30000-32767), so that no reply
    /// is addressed to a node address and a NodePort: a socket load balancer or kube-proxy on
    /// the backend's node may take it for a new connection to that NodePort and never send it
    /// back. 33,512 ports per (node address, backend, protocol) with the kernel's defaults.
    pub const SNAT_PORT_MIN: u16 = 1_024;
    pub const SNAT_PORT_MAX: u16 = 65_535;
    /// What the kernel skips when the agent wrote no `DatapathConfig`: the default NodePort
    /// range and Linux's default ephemeral range, which meet.
    pub const SNAT_SKIP_MIN: u16 = 30_000;
    pub const SNAT_SKIP_MAX: u16 = 60_999;

    /// `CtState::tcp_seen` bits: what the flow has shown so far (drives the timeout).
    pub const TCP_SYN: u8 = 1 << 0;
    pub const TCP_FIN: u8 = 1 << 1;
    pub const TCP_RST: u8 = 1 << 2;
    /// A packet without SYN came after the SYN: the handshake went through.
    pub const TCP_ESTABLISHED: u8 = 1 << 3;
    /// The backend sent the first FIN: it holds the tuple (backend, SNAT address and port) in
    /// TIME_WAIT for 60 s after the close, so the SNAT port must not go to a new flow to that
    /// backend before then.
    pub const TCP_BACKEND_CLOSED_FIRST: u8 = 1 << 4;

    /// Timeouts (nanoseconds since the last packet that refreshed the flow): a flow older than
    /// this is gone; its tuple and SNAT port are free and a new packet is a new flow.
    /// Half-open (only the client's SYNs refresh it, so a SYN flood ages out 30 s after it
    /// stops): shorter than netfilter's 60 s SYN_RECV.
    pub const TIMEOUT_TCP_SYN_NS: u64 = 30 * 1_000_000_000;
    pub const TIMEOUT_TCP_ESTABLISHED_NS: u64 = 21_600 * 1_000_000_000;
    /// After a FIN or RST (a SYN reusing the tuple is a new flow at once; this keeps the
    /// translation for retransmitted FINs and the last ACK).
    pub const TIMEOUT_TCP_CLOSING_NS: u64 = 10 * 1_000_000_000;
    /// After the backend closed first ([`TCP_BACKEND_CLOSED_FIRST`], no RST): Linux's 60 s
    /// TIME_WAIT and a margin.
    pub const TIMEOUT_TCP_TIME_WAIT_NS: u64 = 65 * 1_000_000_000;
    pub const TIMEOUT_NON_TCP_NS: u64 = 60 * 1_000_000_000;
    /// `CtState::last_seen_ns` is written when it is this much older than the packet (or the
    /// state changed), not on every packet; timeouts are that much longer at most.
    pub const REFRESH_NS: u64 = 1_000_000_000;
    /// A RST counts (closes the tracked flow) only when its sequence number is within this many
    /// bytes of the next one expected from its sender: a spoofed RST with a random sequence
    /// number hits it once in 2,048 tries, and then the endpoint's own check (RFC 5961) still
    /// stands. A RST outside it is passed on and the flow stays established.
    pub const RST_WINDOW: u32 = 1 << 20;
    /// A fragment map entry older than this is ignored (Linux's own reassembly timeout): the
    /// IP identification may have been reused by then.
    pub const FRAGMENT_TIMEOUT_NS: u64 = 30 * 1_000_000_000;

    /// How long an entry in `state` lives without traffic.
    pub const fn timeout_ns(proto: u8, tcp_seen: u8) -> u64 {
        if proto != super::IPPROTO_TCP {
            TIMEOUT_NON_TCP_NS
        } else if tcp_seen & TCP_RST != 0 {
            TIMEOUT_TCP_CLOSING_NS
        } else if tcp_seen & TCP_FIN != 0 {
            if tcp_seen & TCP_BACKEND_CLOSED_FIRST != 0 { TIMEOUT_TCP_TIME_WAIT_NS } else { TIMEOUT_TCP_CLOSING_NS }
        } else if tcp_seen & TCP_ESTABLISHED != 0 {
            TIMEOUT_TCP_ESTABLISHED_NS
        } else {
            TIMEOUT_TCP_SYN_NS
        }
    }

    /// Whether a flow in `state` is gone at `now_ns` (CLOCK_MONOTONIC, as `bpf_ktime_get_ns`).
    /// The agent's garbage collection and the kernel's port search use the same rule.
    ///
    /// Saturating: a packet reads the clock when it arrives, and another CPU may refresh the
    /// entry with a later time before this one looks at it. A wrapping difference would make
    /// that live entry look 584 years old: its SNAT port handed to another flow, its next
    /// packet treated as a new flow (seen under a SYN flood as a reset long-lived connection).
    pub const fn is_expired(state: &super::CtState, proto: u8, now_ns: u64) -> bool {
        now_ns.saturating_sub(state.last_seen_ns) > timeout_ns(proto, state.tcp_seen) + REFRESH_NS
    }
}

/// Key of the fragment map: a datagram as the node received it (RFC 791's reassembly key).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragKey4 {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub id_be: u16,
    pub proto: u8,
    pub pad: u8,
}
const _: () = assert!(size_of::<FragKey4>() == 12);

/// Value of the fragment map: the addresses the first fragment left with, and whether the
/// program sent it on itself (SNAT: the later ones must be redirected alike).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragValue4 {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub created_ns: u64,
    pub redirect: u8,
    pub pad: [u8; 7],
}
const _: () = assert!(size_of::<FragValue4>() == 24);

/// [`FragKey4`] for IPv6 (the Fragment header's 32-bit identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragKey6 {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub id_be: u32,
    pub proto: u8,
    pub pad: [u8; 3],
}
const _: () = assert!(size_of::<FragKey6>() == 40);

/// [`FragValue4`] for IPv6.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragValue6 {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub created_ns: u64,
    pub redirect: u8,
    pub pad: [u8; 7],
}
const _: () = assert!(size_of::<FragValue6>() == 48);

/// The agent's settings for the kernel programs (`epx_cfg_v1`, an array of one). All zero (an
/// agent that has not written it yet) means the ABI defaults. Reserved space keeps the layout
/// (and so the pinned map) when a setting is added.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct DatapathConfig {
    /// SNAT source ports: `snat_port_min..=snat_port_max` without the ports of two skips,
    /// `snat_skip_min..=snat_skip_max` and `snat_skip2_min..=snat_skip2_max`. A skip is empty
    /// when its max is below its min or its min is 0 (so the reserved space of an older agent's
    /// layout reads as no second skip); non-empty skips lie inside the range, the first below
    /// the second.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    pub snat_skip_min: u16,
    pub snat_skip_max: u16,
    pub snat_skip2_min: u16,
    pub snat_skip2_max: u16,
    pub reserved: [u32; 13],
}
const _: () = assert!(size_of::<DatapathConfig>() == 64);

/// How many ports an inclusive skip `(min, max)` holds: 0 when it is empty.
const fn skip_len(skip: (u16, u16)) -> u32 {
    if skip.0 == 0 || skip.1 < skip.0 { 0 } else { skip.1 as u32 - skip.0 as u32 + 1 }
}

impl DatapathConfig {
    /// The SNAT port range with the ABI defaults for what is unset: `(min, max, [skip; 2])`.
    pub const fn snat_range(&self) -> (u16, u16, [(u16, u16); 2]) {
        if self.snat_port_max == 0 {
            return (ct::SNAT_PORT_MIN, ct::SNAT_PORT_MAX, [(ct::SNAT_SKIP_MIN, ct::SNAT_SKIP_MAX), (0, 0)]);
        }
        (
            self.snat_port_min,
            self.snat_port_max,
            [(self.snat_skip_min, self.snat_skip_max), (self.snat_skip2_min, self.snat_skip2_max)],
        )
    }

    /// How many ports the SNAT range holds.
    pub const fn snat_port_count(&self) -> u32 {
        let (min, max, skips) = self.snat_range();
        (max as u32 - min as u32 + 1) - skip_len(skips[0]) - skip_len(skips[1])
    }

    /// The `index`-th port of the range (`index < snat_port_count()`), skipping the holes.
    pub const fn snat_port(&self, index: u32) -> u16 {
        let (min, _, skips) = self.snat_range();
        let mut port = min as u32 + index;
        if skip_len(skips[0]) > 0 && port >= skips[0].0 as u32 {
            port += skip_len(skips[0]);
        }
        if skip_len(skips[1]) > 0 && port >= skips[1].0 as u32 {
            port += skip_len(skips[1]);
        }
        port as u16
    }
}

/// The IPv4 address of each interface the TC programs are attached to (`epx_ifaddr4_v1`, keyed
/// by ifindex): the SNAT source for externalIP and LoadBalancer traffic that arrived there.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct IfAddr4 {
    pub addr_be: u32,
}
const _: () = assert!(size_of::<IfAddr4>() == 4);

/// `AffinityKey4::kind`: what identifies the client, and how it is written in `client`.
pub mod affinity {
    /// The client's network namespace cookie (socket hooks: a pod, or the node itself): low
    /// 32 bits in `client[0]`, high in `client[1]`.
    pub const CLIENT_NETNS: u8 = 0;
    /// The client's IPv4 source address (packet path), in `client[0]`.
    pub const CLIENT_IP4: u8 = 1;
    /// The client's IPv6 source address (packet path), all of it.
    pub const CLIENT_IP6: u8 = 2;

    /// `client` of a network namespace cookie.
    #[inline(always)]
    pub const fn netns_client(cookie: u64) -> [u32; 4] {
        [cookie as u32, (cookie >> 32) as u32, 0, 0]
    }

    /// The cookie of a [`CLIENT_NETNS`] entry's `client`.
    pub const fn netns_cookie(client: &[u32; 4]) -> u64 {
        client[0] as u64 | (client[1] as u64) << 32
    }

    /// `client` of an IPv4 address (network byte order).
    #[inline(always)]
    pub const fn ip4_client(addr_be: u32) -> [u32; 4] {
        [addr_be, 0, 0, 0]
    }
}

/// Key of the session-affinity LRU (`sessionAffinity: ClientIP`): a client and a frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct AffinityKey4 {
    /// `affinity::CLIENT_*` says what this is; an IPv6 address in network byte order as
    /// `bpf_sock_addr::user_ip6`.
    pub client: [u32; 4],
    pub rev_nat_id: u16,
    /// `affinity::CLIENT_*`.
    pub kind: u8,
    pub pad: [u8; 5],
}
const _: () = assert!(size_of::<AffinityKey4>() == 24);

/// Value of the session-affinity LRU: the backend the client was sent to, and when it last was.
/// An entry older than the frontend's timeout is ignored; the agent deletes entries whose
/// backend left the frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct AffinityValue4 {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the last use.
    pub last_used_ns: u64,
    pub backend_id: u32,
    pub pad: [u8; 4],
}
const _: () = assert!(size_of::<AffinityValue4>() == 16);

/// Key of the conntrack LRU: a 5-tuple as the node sees it, plus its direction.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct CtKey4 {
    pub saddr_be: u32,
    pub daddr_be: u32,
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    pub dir: u8,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<CtKey4>() == 16);

/// What a tracked flow has shown, kept alike in both of its entries (each direction writes its
/// own entry and copies state changes to the other, so either one can be judged alone).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtState {
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the last packet that refreshed the flow
    /// (written at most every `ct::REFRESH_NS`).
    pub last_seen_ns: u64,
    /// TCP: the sequence number expected next from the sender of the packets this entry matches
    /// (host byte order), for the RST check; 0 before its first packet.
    pub seq_next: u32,
    /// `ct::TCP_*` bits.
    pub tcp_seen: u8,
    pub pad: [u8; 3],
}
const _: () = assert!(size_of::<CtState>() == 16);

/// Value of the conntrack LRU. Forward entries (`ct::DIR_FORWARD`) say which backend the flow
/// was sent to; reply entries (`ct::DIR_REPLY`) say which frontend the reply must come from.
/// Both carry the whole translation so `dump` can print either.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtEntry4 {
    pub backend_addr_be: u32,
    pub frontend_addr_be: u32,
    pub client_addr_be: u32,
    /// The node address the flow was SNATed to (SNATed flows only).
    pub snat_addr_be: u32,
    pub backend_port_be: u16,
    pub frontend_port_be: u16,
    pub client_port_be: u16,
    pub snat_port_be: u16,
    pub backend_id: u32,
    pub rev_nat_id: u16,
    /// `ct::NAT_*` bits.
    pub nat: u8,
    pub pad: u8,
    pub state: CtState,
}
const _: () = assert!(size_of::<CtEntry4>() == 48);

/// Maglev consistent hashing for the packet path (`--lb-algorithm maglev`): the agent builds a
/// table per external frontend from the frontend's backend set; the kernel indexes it with a hash
/// of the flow. Both functions here are used by the kernel and by tests that predict its choice.
pub mod maglev {
    /// Slots per table: a prime, about 400 × the backends of a typical Service, so that a change
    /// of one backend of N moves little more than 1/N of the flows (the paper's rule is 100 ×).
    pub const TABLE_SIZE: u32 = 4093;

    /// [`flow_hash`] for an IPv6 client: its address folded to 32 bits first.
    #[inline(always)]
    pub fn flow_hash6(client_addr: &[u32; 4], client_port_be: u16, frontend_port_be: u16, proto: u8) -> u32 {
        flow_hash(client_addr[0] ^ client_addr[1] ^ client_addr[2] ^ client_addr[3], client_port_be, frontend_port_be, proto)
    }

    /// The flow's hash. It covers the client's address and port, the protocol and the frontend's
    /// port, but not the frontend's address: the same client flow then lands on the same backend
    /// through any node, and through any of a Service's NodePort addresses or LB IPs.
    #[inline(always)]
    pub fn flow_hash(client_addr_be: u32, client_port_be: u16, frontend_port_be: u16, proto: u8) -> u32 {
        // Byte order is fixed (network), so every node computes the same value.
        let mut x = (u64::from(u32::from_be(client_addr_be)) << 32)
            | (u64::from(u16::from_be(client_port_be)) << 16)
            | u64::from(u16::from_be(frontend_port_be));
        x ^= u64::from(proto) << 56 | u64::from(proto);
        // SplitMix64's finaliser.
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (x ^ (x >> 31)) as u32
    }

    /// The table slot of a flow hash.
    #[inline(always)]
    pub fn slot(hash: u32) -> usize {
        (hash % TABLE_SIZE) as usize
    }
}

/// Value of the Maglev map: slot -> backend id (a key of the backend map).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaglevTable4 {
    pub backend_ids: [u32; maglev::TABLE_SIZE as usize],
}
const _: () = assert!(size_of::<MaglevTable4>() == 4 * maglev::TABLE_SIZE as usize);

/// The IPv6 address of an interface the TC programs are attached to (`epx_ifaddr6_v1`, keyed by
/// ifindex): the SNAT source for IPv6 externalIP and LoadBalancer traffic that arrived there.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct IfAddr6 {
    pub addr: [u32; 4],
}
const _: () = assert!(size_of::<IfAddr6>() == 16);

/// Key of the IPv6 conntrack LRU (`epx_ct6_v1`): as [`CtKey4`] with 128-bit addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct CtKey6 {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport_be: u16,
    pub dport_be: u16,
    pub proto: u8,
    pub dir: u8,
    pub pad: [u8; 2],
}
const _: () = assert!(size_of::<CtKey6>() == 40);

/// Value of the IPv6 conntrack LRU: as [`CtEntry4`] with 128-bit addresses.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtEntry6 {
    pub backend_addr: [u32; 4],
    pub frontend_addr: [u32; 4],
    pub client_addr: [u32; 4],
    pub snat_addr: [u32; 4],
    pub backend_port_be: u16,
    pub frontend_port_be: u16,
    pub client_port_be: u16,
    pub snat_port_be: u16,
    pub backend_id: u32,
    pub rev_nat_id: u16,
    pub nat: u8,
    pub pad: u8,
    pub state: CtState,
}
const _: () = assert!(size_of::<CtEntry6>() == 96);

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: all of these are `repr(C)` plain integers with explicit padding: every bit pattern
    // is valid and there are no implicit padding bytes.
    unsafe impl aya::Pod for ServiceKey4 {}
    unsafe impl aya::Pod for ServiceValue4 {}
    unsafe impl aya::Pod for Backend4 {}
    unsafe impl aya::Pod for RevNat4 {}
    unsafe impl aya::Pod for RevSockKey4 {}
    unsafe impl aya::Pod for RevSock4 {}
    unsafe impl aya::Pod for CtKey4 {}
    unsafe impl aya::Pod for CtEntry4 {}
    unsafe impl aya::Pod for IfAddr4 {}
    unsafe impl aya::Pod for AffinityKey4 {}
    unsafe impl aya::Pod for AffinityValue4 {}
    unsafe impl aya::Pod for MaglevTable4 {}
    unsafe impl aya::Pod for ServiceKey6 {}
    unsafe impl aya::Pod for Backend6 {}
    unsafe impl aya::Pod for RevNat6 {}
    unsafe impl aya::Pod for RevSockKey6 {}
    unsafe impl aya::Pod for RevSock6 {}
    unsafe impl aya::Pod for IfAddr6 {}
    unsafe impl aya::Pod for CtKey6 {}
    unsafe impl aya::Pod for CtEntry6 {}
    unsafe impl aya::Pod for CtState {}
    unsafe impl aya::Pod for DatapathConfig {}
    unsafe impl aya::Pod for FragKey4 {}
    unsafe impl aya::Pod for FragValue4 {}
    unsafe impl aya::Pod for FragKey6 {}
    unsafe impl aya::Pod for FragValue6 {}
    unsafe impl aya::Pod for SockFlowKey4 {}
    unsafe impl aya::Pod for SockFlowKey6 {}
    unsafe impl aya::Pod for SockFlow {}
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(last_seen_ns: u64, tcp_seen: u8) -> CtState {
        CtState { last_seen_ns, seq_next: 0, tcp_seen, pad: [0; 3] }
    }

    #[test]
    fn an_entry_stamped_after_the_packet_read_the_clock_is_live() {
        // Another CPU refreshed it 5 µs after this packet's `now`.
        let now = 1_000_000_000_000;
        assert!(!ct::is_expired(&state(now + 5_000, ct::TCP_SYN | ct::TCP_ESTABLISHED), IPPROTO_TCP, now));
        assert!(!ct::is_expired(&state(now + 5_000, ct::TCP_SYN), IPPROTO_TCP, now));
    }

    #[test]
    fn timeouts_follow_what_the_flow_has_shown() {
        let s = 1_000_000_000u64;
        let t0 = 100_000 * s;
        let expired_after = |tcp_seen: u8, proto: u8, secs: u64| ct::is_expired(&state(t0, tcp_seen), proto, t0 + secs * s);
        let established = ct::TCP_SYN | ct::TCP_ESTABLISHED;
        assert!(!expired_after(ct::TCP_SYN, IPPROTO_TCP, 30) && expired_after(ct::TCP_SYN, IPPROTO_TCP, 32));
        assert!(!expired_after(established, IPPROTO_TCP, 21_600) && expired_after(established, IPPROTO_TCP, 21_602));
        assert!(expired_after(established | ct::TCP_FIN, IPPROTO_TCP, 12));
        let time_wait = established | ct::TCP_FIN | ct::TCP_BACKEND_CLOSED_FIRST;
        assert!(!expired_after(time_wait, IPPROTO_TCP, 60) && expired_after(time_wait, IPPROTO_TCP, 67));
        assert!(expired_after(time_wait | ct::TCP_RST, IPPROTO_TCP, 12), "a RST leaves no TIME_WAIT");
        assert!(!expired_after(0, IPPROTO_UDP, 60) && expired_after(0, IPPROTO_UDP, 62));
    }
}

/// Every pinned map's layout, in one table: the agent sizes the maps it loads and checks the
/// pins it finds against it, and a test of the agent compares it with the compiled kernel object
/// (whose `#[map]` declarations in `proxy-ebpf/src/maps.rs` take only literals), so the three
/// cannot drift apart unnoticed.
pub mod layout {
    use super::*;

    /// The kernel's map type (`enum bpf_map_type`).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Kind {
        Hash = 1,
        Array = 2,
        PerCpuArray = 6,
        LruHash = 9,
    }

    /// What sets a map's capacity: a constant of this build, or one of the agent's
    /// `--map-size-*` flags (whose default is the kernel object's).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Size {
        Fixed(u32),
        Services,
        Backends,
        RevNat,
        RevSock,
        Ct,
        Affinity,
        RevSock6,
        Ct6,
    }

    impl Size {
        /// The capacity the kernel object declares (the flag's default).
        pub const fn default_entries(self) -> u32 {
            match self {
                Size::Fixed(entries) => entries,
                Size::Services => capacity::SERVICES4,
                Size::Backends => capacity::BACKENDS4,
                Size::RevNat => capacity::REV_NAT4,
                Size::RevSock => capacity::REV_SOCK4,
                Size::Ct => capacity::CT4,
                Size::Affinity => capacity::AFFINITY4,
                Size::RevSock6 => capacity::REV_SOCK6,
                Size::Ct6 => capacity::CT6,
            }
        }
    }

    /// `BPF_F_NO_PREALLOC`.
    pub const NO_PREALLOC: u32 = 1;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub struct Spec {
        pub name: &'static str,
        pub kind: Kind,
        pub key_size: u32,
        pub value_size: u32,
        pub size: Size,
        pub flags: u32,
    }

    const fn spec<K, V>(name: &'static str, kind: Kind, size: Size) -> Spec {
        Spec { name, kind, key_size: size_of::<K>() as u32, value_size: size_of::<V>() as u32, size, flags: 0 }
    }

    /// In the order of [`map_name::ALL`].
    pub const MAPS: [Spec; 20] = [
        spec::<ServiceKey4, ServiceValue4>(map_name::SERVICES4, Kind::Hash, Size::Services),
        spec::<BackendId, Backend4>(map_name::BACKENDS4, Kind::Hash, Size::Backends),
        spec::<RevNatId, RevNat4>(map_name::REV_NAT4, Kind::Hash, Size::RevNat),
        spec::<RevSockKey4, RevSock4>(map_name::REV_SOCK4, Kind::LruHash, Size::RevSock),
        spec::<u32, u64>(map_name::STATS, Kind::PerCpuArray, Size::Fixed(stat::SLOTS)),
        spec::<CtKey4, CtEntry4>(map_name::CT4, Kind::LruHash, Size::Ct),
        spec::<u32, IfAddr4>(map_name::IFADDR4, Kind::Hash, Size::Fixed(capacity::IFADDR4)),
        spec::<AffinityKey4, AffinityValue4>(map_name::AFFINITY4, Kind::LruHash, Size::Affinity),
        Spec { flags: NO_PREALLOC, ..spec::<u32, MaglevTable4>(map_name::MAGLEV4, Kind::Hash, Size::Fixed(capacity::MAGLEV4)) },
        spec::<ServiceKey6, ServiceValue4>(map_name::SERVICES6, Kind::Hash, Size::Services),
        spec::<BackendId, Backend6>(map_name::BACKENDS6, Kind::Hash, Size::Backends),
        spec::<RevNatId, RevNat6>(map_name::REV_NAT6, Kind::Hash, Size::RevNat),
        spec::<RevSockKey6, RevSock6>(map_name::REV_SOCK6, Kind::LruHash, Size::RevSock6),
        spec::<CtKey6, CtEntry6>(map_name::CT6, Kind::LruHash, Size::Ct6),
        spec::<u32, IfAddr6>(map_name::IFADDR6, Kind::Hash, Size::Fixed(capacity::IFADDR6)),
        spec::<u32, DatapathConfig>(map_name::CONFIG, Kind::Array, Size::Fixed(1)),
        spec::<FragKey4, FragValue4>(map_name::FRAG4, Kind::LruHash, Size::Fixed(capacity::FRAG4)),
        spec::<FragKey6, FragValue6>(map_name::FRAG6, Kind::LruHash, Size::Fixed(capacity::FRAG6)),
        spec::<SockFlowKey4, SockFlow>(map_name::SOCK_FLOW4, Kind::LruHash, Size::Fixed(capacity::SOCK_FLOW4)),
        spec::<SockFlowKey6, SockFlow>(map_name::SOCK_FLOW6, Kind::LruHash, Size::Fixed(capacity::SOCK_FLOW6)),
    ];
}
