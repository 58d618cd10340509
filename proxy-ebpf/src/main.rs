//! Kernel programs of ebpf-proxy. One module per hook family; the maps live in `maps`.
//!
//! Built only by `cargo xtask build` (bpfel-unknown-none, build-std=core).
#![no_std]
#![no_main]

mod ct;
mod failure;
mod frag;
mod affinity;
mod maps;
mod packet;
mod packet6;
mod reject;
mod route;
mod sock;
mod tc;
mod tc6;

/// Rotation applied to random slot picks: 0, except in the build xtask makes with
/// `EPX_EBPF_VARIANT` set, whose connect/sendmsg programs then differ in code (not in behaviour:
/// a rotated random number is as random). The upgrade test swaps one build for the other.
const VARIANT_ROTATE: u32 = match option_env!("EPX_EBPF_VARIANT") {
    Some(_) => 7,
    None => 0,
};

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path; this is never executed.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
