//! The datapath's rare failure paths, each counted in the per-CPU stats and logged through
//! aya-log with what the kernel returned (the agent prints it with its own log lines). Only
//! these paths log: a packet or a socket call that goes through never reaches this module, so
//! logging costs nothing there (STYLE: no logging on the per-packet path). A failure repeated per packet (a
//! full SNAT range under a flood) fills the 128 KiB log ring, whose writes then fail without
//! delaying the packet; the counters stay exact.

use aya_ebpf::programs::TcContext;
use aya_log_ebpf::warn;
use proxy_abi::stat;

use crate::maps::count;
use crate::packet::RewriteFailed;
use crate::route::NoRoute;

/// Set in the build `cargo xtask bench` compares the shipped one with (`EPX_EBPF_NO_LOG`): the
/// same programs without the log calls, so the benchmark shows what logging costs per packet.
const NO_LOG: bool = option_env!("EPX_EBPF_NO_LOG").is_some();

/// aya-log's `warn!`, left out of the [`NO_LOG`] build.
macro_rules! log {
    ($($arg:tt)*) => {
        if !NO_LOG {
            warn!($($arg)*);
        }
    };
}

/// A rewrite or checksum helper failed: the packet is dropped rather than sent half-rewritten.
#[inline(never)]
pub fn rewrite(ctx: &TcContext, failed: RewriteFailed) {
    count(stat::TC_REWRITE_FAIL);
    log!(ctx, "packet rewrite failed (helper returned {}): dropped", failed.0);
}

/// The route lookup or redirect of a packet the program forwards itself failed: dropped.
#[inline(never)]
pub fn route(ctx: &TcContext, failed: NoRoute) {
    count(stat::TC_FIB_FAIL);
    log!(ctx, "route lookup or redirect failed (returned {}): dropped", failed.0);
}

/// A packet the program must send on itself is larger than the next link's MTU and no ICMP
/// error could be sent for it (IPv4 without DF: nothing here fragments; IP options or IPv6
/// extension headers: no quote fits): dropped.
#[inline(never)]
pub fn too_big(ctx: &TcContext, len: u32, mtu: u16) {
    count(stat::TC_TOO_BIG_DROP);
    log!(ctx, "a {}-byte frame does not fit the next link's MTU {} and cannot be answered with an ICMP error: dropped", len, mtu);
}

/// Every SNAT source port of the range is held by a live flow to this backend: dropped.
#[inline(never)]
pub fn no_snat_port(ctx: &TcContext, backend_port_be: u16) {
    count(stat::TC_SNAT_NO_PORT);
    log!(
        ctx,
        "no free SNAT port in the range for a new flow to backend port {}: dropped (widen --snat-port-range)",
        u16::from_be(backend_port_be)
    );
}

/// An LRU entry could not be written (`counter` says which; what still works is said where it
/// is counted). An LRU evicts instead of filling up, so this is a kernel error (memory).
#[inline(never)]
pub fn map_insert(counter: u32, map: &str, rc: i32) {
    count(counter);
    // aya-log's first argument (a context) is not used by this version; these callers have none.
    log!(&(), "insert into {} failed (returned {})", map, rc);
}

/// The conntrack entries of a new flow could not be inserted (the packet is still translated).
#[inline(never)]
pub fn conntrack_insert(ctx: &TcContext) {
    count(stat::TC_CT_RECORD_FAIL);
    log!(ctx, "conntrack insert failed: the flow is translated but not tracked");
}
