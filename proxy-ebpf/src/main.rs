//! Kernel programs of ebpf-proxy. One module per hook family; the maps live in `maps`.
//!
//! Built only by `cargo xtask build` (bpfel-unknown-none, build-std=core).
#![no_std]
#![no_main]

mod maps;
mod sock;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // The verifier rejects any reachable panic path; this is never executed.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
