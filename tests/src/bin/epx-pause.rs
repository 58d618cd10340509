//! The pod sandbox's init process for the local node's pause image: it holds the pod's
//! namespaces, reaps the children that get reparented to it (it is PID 1 of the pod when the pod
//! shares its PID namespace), and exits at once on SIGTERM or SIGINT, as upstream's `pause` does.

fn main() {
    // SAFETY: plain signal-mask calls on a zeroed sigset_t, before any other thread exists.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGCHLD] {
            libc::sigaddset(&mut set, signal);
        }
        // Blocked, so they are taken with sigwait instead of by (default: ignored for PID 1) handlers.
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        loop {
            let mut signal = 0;
            if libc::sigwait(&set, &mut signal) != 0 {
                continue;
            }
            match signal {
                libc::SIGCHLD => while libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) > 0 {},
                _ => std::process::exit(0),
            }
        }
    }
}
