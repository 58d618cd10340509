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
    pub const STATS: &str = "epx_stats_v1";

    /// Every map the agent owns, in the order `dump` prints them.
    pub const ALL: [&str; 5] = [SERVICES4, BACKENDS4, REV_NAT4, REV_SOCK4, STATS];
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
    pub const COUNT: u32 = 5;

    pub const NAMES: [&str; COUNT as usize] =
        ["sock_xlate", "sock_no_backend", "sock_lookup_miss", "sock_rev_xlate", "sock_rev_record_fail"];
}

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
}
