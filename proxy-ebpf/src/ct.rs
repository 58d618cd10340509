//! Connection tracking for the TC programs: which backend a flow was sent to (forward entries,
//! looked up before the service map so a flow keeps its backend when the backend set changes),
//! and which frontend its replies must come from (reply entries).
//!
//! The table is an LRU of stated size (`epx_ct4_v2`). Both entries of a flow carry its state
//! ([`CtState`]): each direction updates the entry it matched and copies a state change (or a
//! refresh, at most once a second) to the other, so either entry can be judged alone — by the
//! port search below, which frees the ports of flows past their timeout (`ct::is_expired`, shared
//! with the agent's garbage collection), and by the agent, which deletes expired entries in the
//! background so the LRU holds live flows.
//!
//! SNAT ports are claimed by inserting the flow's reply entry with `BPF_NOEXIST`: two CPUs
//! picking the same port cannot both win, and a port is held exactly as long as that entry lives.

use aya_ebpf::{bindings::BPF_NOEXIST, helpers::bpf_ktime_get_ns, maps::LruHashMap};
use proxy_abi::{ct, stat, CtEntry4, CtEntry6, CtKey4, CtKey6, CtState, IPPROTO_TCP};

use crate::maps::{count, CT4};
use crate::packet::{Flow, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};

const EEXIST: i32 = 17;

#[inline(always)]
pub fn now_ns() -> u64 {
    unsafe { bpf_ktime_get_ns() }
}

#[inline(always)]
pub fn forward_key(flow: &Flow) -> CtKey4 {
    CtKey4 {
        saddr_be: flow.saddr_be,
        daddr_be: flow.daddr_be,
        sport_be: flow.sport_be,
        dport_be: flow.dport_be,
        proto: flow.proto,
        dir: ct::DIR_FORWARD,
        pad: [0; 2],
    }
}

/// The key under which a packet is looked up as a reply.
#[inline(always)]
pub fn reply_key(flow: &Flow) -> CtKey4 {
    CtKey4 { dir: ct::DIR_REPLY, ..forward_key(flow) }
}

/// The forward key of the flow an entry belongs to (client -> frontend).
#[inline(always)]
pub fn forward_key_of(entry: &CtEntry4, proto: u8) -> CtKey4 {
    CtKey4 {
        saddr_be: entry.client_addr_be,
        daddr_be: entry.frontend_addr_be,
        sport_be: entry.client_port_be,
        dport_be: entry.frontend_port_be,
        proto,
        dir: ct::DIR_FORWARD,
        pad: [0; 2],
    }
}

/// The TCP state bits after a packet with `flags` (RSTs already judged by [`observe`]). A bare
/// SYN starts the flow over (a client reusing its port after a close), everything else
/// accumulates.
#[inline(always)]
pub fn tcp_seen_after(seen: u8, proto: u8, flags: u8, from_backend: bool) -> u8 {
    if proto != IPPROTO_TCP {
        return 0;
    }
    if flags & (TCP_SYN | TCP_ACK) == TCP_SYN {
        return ct::TCP_SYN;
    }
    let mut seen = seen;
    if flags & TCP_SYN == 0 && seen & ct::TCP_SYN != 0 {
        seen |= ct::TCP_ESTABLISHED;
    }
    if flags & TCP_FIN != 0 {
        if seen & ct::TCP_FIN == 0 && from_backend {
            seen |= ct::TCP_BACKEND_CLOSED_FIRST;
        }
        seen |= ct::TCP_FIN;
    }
    if flags & TCP_RST != 0 {
        seen |= ct::TCP_RST;
    }
    seen
}

/// What conntrack reads of one packet.
#[derive(Clone, Copy)]
pub struct Packet {
    pub proto: u8,
    pub flags: u8,
    pub seq: u32,
    pub seq_end: u32,
}

impl Packet {
    #[inline(always)]
    pub fn of(flow: &Flow) -> Self {
        Self { proto: flow.proto, flags: flow.tcp_flags, seq: flow.seq, seq_end: flow.seq_end }
    }
}

/// The state a new flow's entries start with: the forward entry knows the client's next
/// sequence number, the reply entry learns the backend's from its first answer.
#[inline(always)]
pub fn new_state(packet: &Packet, now: u64) -> CtState {
    CtState {
        last_seen_ns: now,
        seq_next: 0,
        tcp_seen: tcp_seen_after(0, packet.proto, packet.flags, false),
        pad: [0; 3],
    }
}

/// Whether `seq` is near enough to `seq_next` (`ct::RST_WINDOW`) to be the sender's.
#[inline(always)]
fn in_window(seq_next: u32, seq: u32) -> bool {
    seq.wrapping_sub(seq_next).wrapping_add(ct::RST_WINDOW) <= 2 * ct::RST_WINDOW
}

/// Applies one packet, from the client or (`from_backend`) from the backend, to the state of the
/// entry it matched. True when the flow's other entry must hear of it: the TCP state changed,
/// or the entry was refreshed (at most once per `ct::REFRESH_NS`, so a busy flow writes its
/// entries about once a second instead of on every packet).
///
/// A RST too far from its sender's next sequence number does not close the flow (a spoofed RST
/// must not turn an established flow into one whose port is soon reused), and a packet that far
/// does not move the sequence number either. A half-open flow is refreshed only by the client's
/// SYNs: a SYN flood ages out `ct::TIMEOUT_TCP_SYN_NS` after it stops, whatever the backend's
/// SYN-ACK retransmissions do.
#[inline(always)]
pub fn observe(state: &mut CtState, packet: &Packet, from_backend: bool, now: u64) -> bool {
    // Saturating, as `ct::is_expired`: another CPU may have stamped the entry after `now`.
    let stale = now.saturating_sub(state.last_seen_ns) >= ct::REFRESH_NS;
    if packet.proto != IPPROTO_TCP {
        if stale {
            state.last_seen_ns = now;
        }
        return stale;
    }
    let mut flags = packet.flags;
    let known = state.seq_next != 0;
    if known && !in_window(state.seq_next, packet.seq) {
        if flags & TCP_RST != 0 {
            count(stat::TC_RST_OUT_OF_WINDOW);
        }
        flags &= !TCP_RST;
    } else if !known || packet.seq_end.wrapping_sub(state.seq_next) as i32 > 0 {
        state.seq_next = packet.seq_end;
    }
    let seen = tcp_seen_after(state.tcp_seen, packet.proto, flags, from_backend);
    let changed = seen != state.tcp_seen;
    let refresh = changed || (stale && (!from_backend || seen & ct::TCP_ESTABLISHED != 0));
    state.tcp_seen = seen;
    if refresh {
        state.last_seen_ns = now;
    }
    refresh
}

/// The two entries of a flow, in either family.
pub trait Entry {
    fn state(&self) -> &CtState;
    fn state_mut(&mut self) -> &mut CtState;
    /// The same translation (so the same flow): a later flow on the same forward tuple has
    /// another SNAT port or backend, and must not take an old flow's state.
    fn same_flow(&self, other: &Self) -> bool;
}

impl Entry for CtEntry4 {
    #[inline(always)]
    fn state(&self) -> &CtState {
        &self.state
    }
    #[inline(always)]
    fn state_mut(&mut self) -> &mut CtState {
        &mut self.state
    }
    #[inline(always)]
    fn same_flow(&self, other: &Self) -> bool {
        self.backend_addr_be == other.backend_addr_be
            && self.backend_port_be == other.backend_port_be
            && self.snat_port_be == other.snat_port_be
            && self.client_addr_be == other.client_addr_be
            && self.client_port_be == other.client_port_be
    }
}

impl Entry for CtEntry6 {
    #[inline(always)]
    fn state(&self) -> &CtState {
        &self.state
    }
    #[inline(always)]
    fn state_mut(&mut self) -> &mut CtState {
        &mut self.state
    }
    #[inline(always)]
    fn same_flow(&self, other: &Self) -> bool {
        self.backend_addr == other.backend_addr
            && self.backend_port_be == other.backend_port_be
            && self.snat_port_be == other.snat_port_be
            && self.client_addr == other.client_addr
            && self.client_port_be == other.client_port_be
    }
}

/// Copies `entry`'s TCP state and last-seen time to the flow's other entry at `key`, if that
/// entry still belongs to the same flow.
#[inline(always)]
pub fn share_state<K, V: Entry>(map: &LruHashMap<K, V>, key: &K, entry: &V) {
    if let Some(other) = map.get_ptr_mut(key) {
        let other = unsafe { &mut *other };
        if other.same_flow(entry) {
            let state = other.state_mut();
            state.tcp_seen = entry.state().tcp_seen;
            state.last_seen_ns = entry.state().last_seen_ns;
        }
    }
}

/// The outcome of trying one SNAT port.
pub enum Claim {
    /// The reply entry is in: the port is this flow's.
    Taken,
    /// A live flow holds the port: try the next one.
    Held,
    /// The map refused for another reason: stop.
    Failed,
}

/// Claims `key` (a reply entry naming an SNAT port) for `value`: a `BPF_NOEXIST` insert, so that
/// of two CPUs after the same port only one gets it. A holder past its timeout is deleted first
/// (counted), and the port is tried once more.
#[inline(always)]
pub fn claim<K, V: Entry>(map: &LruHashMap<K, V>, key: &K, value: &V, proto: u8, now: u64) -> Claim {
    match map.insert(key, value, u64::from(BPF_NOEXIST)) {
        Ok(()) => return Claim::Taken,
        Err(error) if error != -EEXIST => return Claim::Failed,
        Err(_) => {}
    }
    let Some(holder) = map.get_ptr(key) else { return Claim::Held };
    if !ct::is_expired(unsafe { (*holder).state() }, proto, now) {
        return Claim::Held;
    }
    let _ = map.remove(key);
    count(stat::TC_CT_EXPIRED_REMOVED);
    match map.insert(key, value, u64::from(BPF_NOEXIST)) {
        Ok(()) => Claim::Taken,
        Err(_) => Claim::Held,
    }
}

/// A SNAT port search in progress (both families' `bpf_loop` context, on the stack): the
/// callback of step `index` tries [`PortSearch::port_be`] and ends with [`PortSearch::after`].
#[repr(C)]
pub struct PortSearch {
    pub now: u64,
    /// A random index into the range, where the search starts.
    pub start: u32,
    /// How many ports the range has (`DatapathConfig::snat_port_count`), as many steps at most.
    pub ports: u32,
    pub proto: u8,
    pub found: u8,
    pub pad: [u8; 6],
}

impl PortSearch {
    /// A search over the configured range from a random port; None when the range is empty.
    #[inline(always)]
    pub fn start(proto: u8, now: u64) -> Option<Self> {
        let ports = crate::maps::CONFIG.get(0).map_or(0, |c| c.snat_port_count());
        let start = unsafe { aya_ebpf::helpers::bpf_get_prandom_u32() }.checked_rem(ports)?;
        Some(Self { now, start, ports, proto, found: 0, pad: [0; 6] })
    }

    /// The port (network byte order) step `index` tries.
    #[inline(always)]
    pub fn port_be(&self, index: u64) -> Option<u16> {
        let config = crate::maps::CONFIG.get(0)?;
        let slot = self.start.wrapping_add(index as u32).checked_rem(self.ports)?;
        Some(config.snat_port(slot).to_be())
    }

    /// `bpf_loop`'s answer after a step: 0 to go on (the port is held), 1 to stop.
    #[inline(always)]
    pub fn after(&mut self, claim: Claim) -> i64 {
        match claim {
            Claim::Taken => {
                self.found = 1;
                1
            }
            Claim::Held => 0,
            Claim::Failed => 1,
        }
    }
}

/// The key of the replies of a flow: backend -> client, or backend -> node address:SNAT port
/// when the flow is SNATed.
#[inline(always)]
pub fn reply_key_of(entry: &CtEntry4, proto: u8, client_addr_be: u32, client_port_be: u16) -> CtKey4 {
    let snat = entry.nat & ct::NAT_SNAT != 0;
    CtKey4 {
        saddr_be: entry.backend_addr_be,
        daddr_be: if snat { entry.snat_addr_be } else { client_addr_be },
        sport_be: entry.backend_port_be,
        dport_be: if snat { entry.snat_port_be } else { client_port_be },
        proto,
        dir: ct::DIR_REPLY,
        pad: [0; 2],
    }
}

/// Records a new flow: the forward entry and (unless the port search already claimed it) the
/// reply entry. Both or an error; a failure removes what was written, so no flow is
/// half-tracked and no port stays claimed by a flow that was not recorded.
#[inline(always)]
pub fn record(flow: &Flow, entry: &CtEntry4, reply_claimed: bool) -> Result<(), ()> {
    let reply = reply_key_of(entry, flow.proto, flow.saddr_be, flow.sport_be);
    if !reply_claimed && CT4.insert(&reply, entry, 0).is_err() {
        return Err(());
    }
    let mut forward = *entry;
    forward.state.seq_next = flow.seq_end;
    if CT4.insert(&forward_key(flow), &forward, 0).is_err() {
        let _ = CT4.remove(&reply);
        return Err(());
    }
    Ok(())
}

/// [`reply_key_of`] for IPv6.
#[inline(always)]
pub fn reply_key_of6(entry: &CtEntry6, proto: u8, client_addr: [u32; 4], client_port_be: u16) -> CtKey6 {
    let snat = entry.nat & ct::NAT_SNAT != 0;
    CtKey6 {
        saddr: entry.backend_addr,
        daddr: if snat { entry.snat_addr } else { client_addr },
        sport_be: entry.backend_port_be,
        dport_be: if snat { entry.snat_port_be } else { client_port_be },
        proto,
        dir: ct::DIR_REPLY,
        pad: [0; 2],
    }
}
