//! Attaching the packet-level programs (`epx_tc_ingress`, `epx_tc_egress`) to the node's
//! interfaces, and detaching them.
//!
//! With tcx (kernel ≥ 6.6) each (program, interface) gets a bpf_link pinned as
//! `<bpffs>/links/<program>@<interface>`; a restarted agent swaps the program inside it
//! (BPF_LINK_UPDATE), so the interface is never without translation. Older kernels get a clsact
//! qdisc and a classic direct-action filter, which outlives the agent by itself; the program is
//! pinned as `links/legacy-tc:<program>@<interface>` only so that `cleanup` knows what to remove.
//! There a restart replaces the filter (detach, attach): a short gap the tcx path does not have.

use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::path::Path;

use aya::programs::links::FdLink;
use aya::programs::tc::{self, NlOptions, TcAttachOptions};
use aya::programs::{LinkOrder, ProgramError, SchedClassifier, TcAttachType};
use aya::sys::SyscallError;

use super::{bpf_link_update, bpf_obj_get, Datapath, DatapathError};

/// The packet-level programs: ELF function name and direction.
pub const TC_PROGRAMS: [(&str, TcAttachType); 2] =
    [("epx_tc_ingress", TcAttachType::Ingress), ("epx_tc_egress", TcAttachType::Egress)];

/// How the programs are attached (`--tc-attach`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// tcx where the kernel has it (≥ 6.6), else a clsact filter.
    Auto,
    /// tcx only: fail on older kernels.
    Tcx,
    /// A clsact filter even where tcx exists (for tests of that path, or next to tools that
    /// only look at classic filters).
    Legacy,
}

impl AttachMode {
    pub fn parse(text: &str) -> Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "tcx" => Ok(Self::Tcx),
            "legacy" => Ok(Self::Legacy),
            _ => Err(format!("unknown attach mode {text:?}: use auto, tcx or legacy")),
        }
    }
}

/// `--interfaces` value that turns the packet-level datapath off.
pub const NO_INTERFACES: &str = "none";

const LEGACY_PREFIX: &str = "legacy-tc:";

/// The interfaces the packet-level programs go on: the `--interfaces` list, `none` for none, or
/// by default every interface holding one of the node's non-loopback IPv4 addresses.
pub fn resolve_interfaces(requested: &[String]) -> io::Result<Vec<String>> {
    match requested {
        [only] if only == NO_INTERFACES => Ok(Vec::new()),
        [] => interfaces_with_addresses(),
        listed => Ok(listed.iter().filter(|name| !name.is_empty()).cloned().collect()),
    }
}

fn interfaces_with_addresses() -> io::Result<Vec<String>> {
    let mut names: Vec<String> = crate::netif::interface_addresses()?
        .into_iter()
        .filter(|(_, addr)| addr.is_ipv4())
        .map(|(name, _)| name)
        .collect();
    names.sort();
    names.dedup();
    Ok(names)
}

fn link_name(program: &str, interface: &str) -> String {
    format!("{program}@{interface}")
}

/// Attaches both programs to every interface in `interfaces`, and detaches them from interfaces
/// that were attached by an earlier run but are no longer listed.
pub fn attach(datapath: &mut Datapath, bpffs: &Path, interfaces: &[String], mode: AttachMode) -> Result<(), DatapathError> {
    let links = bpffs.join("links");
    for (name, attach_type) in TC_PROGRAMS {
        let program: &mut SchedClassifier = datapath
            ._ebpf
            .program_mut(name)
            .ok_or(DatapathError::Missing { kind: "program", name })?
            .try_into()
            .map_err(|source| DatapathError::Program { name, source })?;
        program.load().map_err(|source| DatapathError::Program { name, source })?;
        for interface in interfaces {
            if attach_one(program, name, attach_type, interface, &links, mode)? {
                datapath.attached_anew += 1;
            }
        }
    }
    datapath.flows.record_interface_addresses(interfaces)?;
    detach_unlisted(&links, interfaces)
}

fn attach_one(
    program: &mut SchedClassifier,
    name: &'static str,
    attach_type: TcAttachType,
    interface: &str,
    links: &Path,
    mode: AttachMode,
) -> Result<bool, DatapathError> {
    let pin = links.join(link_name(name, interface));
    let link_err = |action, source| DatapathError::Link { action, path: pin.clone(), source };
    if mode == AttachMode::Legacy {
        // A tcx link from an earlier run would translate a second time.
        if pin.exists() {
            fs::remove_file(&pin).map_err(|e| link_err("remove", e))?;
        }
        return attach_legacy(program, name, attach_type, interface, links).map(|()| true);
    }
    if pin.exists() {
        let prog_fd = program.fd().map_err(|source| DatapathError::Program { name, source })?;
        let link = bpf_obj_get(&pin).map_err(|e| link_err("open pinned", e))?;
        match bpf_link_update(link.as_fd(), prog_fd.as_fd()) {
            Ok(()) => {
                tracing::debug!(program = name, interface, "replaced the program inside the pinned tcx link");
                return Ok(false);
            }
            // The interface went away (maybe it came back with another ifindex): the link is
            // dead, attach anew.
            Err(e) if e.raw_os_error() == Some(libc::ENOLINK) => {
                fs::remove_file(&pin).map_err(|e| link_err("remove dead", e))?;
            }
            Err(e) => return Err(link_err("update", e)),
        }
    }
    // Ingress first: Service translation happens before anything else routes the packet.
    // Egress last: replies are translated back after other programs have seen them.
    let order = match attach_type {
        TcAttachType::Ingress => LinkOrder::first(),
        _ => LinkOrder::last(),
    };
    let attach_err = |source| DatapathError::Interface { program: name, interface: interface.to_owned(), source };
    match program.attach_with_options(interface, attach_type, TcAttachOptions::TcxOrder(order)) {
        Ok(link_id) => {
            let link = program.take_link(link_id).map_err(attach_err)?;
            let link = FdLink::try_from(link).map_err(|e| link_err("convert", io::Error::other(e.to_string())))?;
            link.pin(&pin).map_err(|e| link_err("pin", io::Error::other(e.to_string())))?;
            tracing::info!(program = name, interface, "attached (tcx) and pinned");
            Ok(true)
        }
        // Kernels before 6.6 do not know the tcx attach types.
        Err(ProgramError::SyscallError(SyscallError { io_error, .. }))
            if mode == AttachMode::Auto && io_error.raw_os_error() == Some(libc::EINVAL) =>
        {
            attach_legacy(program, name, attach_type, interface, links).map(|()| true)
        }
        Err(ProgramError::SyscallError(SyscallError { io_error, .. }))
            if mode == AttachMode::Tcx && io_error.raw_os_error() == Some(libc::EINVAL) =>
        {
            Err(DatapathError::MissingKernelFeature {
                feature: "tcx (BPF links for tc)",
                since: "Linux 6.6",
                hint: "use --tc-attach=auto (or legacy) to attach through a clsact qdisc instead",
            })
        }
        Err(source) => Err(attach_err(source)),
    }
}

fn attach_legacy(
    program: &mut SchedClassifier,
    name: &'static str,
    attach_type: TcAttachType,
    interface: &str,
    links: &Path,
) -> Result<(), DatapathError> {
    let attach_err = |source| DatapathError::Interface { program: name, interface: interface.to_owned(), source };
    // Already there is fine; any real problem shows up in the attach below.
    let _ = tc::qdisc_add_clsact(interface);
    // Our filter from an earlier run, if any, is replaced.
    let _ = tc::qdisc_detach_program(interface, attach_type, name);
    let link_id = program
        .attach_with_options(interface, attach_type, TcAttachOptions::Netlink(NlOptions::default()))
        .map_err(attach_err)?;
    let link = program.take_link(link_id).map_err(attach_err)?;
    // Dropping the link would remove the filter; it must outlive the agent.
    std::mem::forget(link);
    let pin = links.join(format!("{LEGACY_PREFIX}{}", link_name(name, interface)));
    let pin_err = |source| DatapathError::Link { action: "pin", path: pin.clone(), source };
    if pin.exists() {
        fs::remove_file(&pin).map_err(pin_err)?;
    }
    program.pin(&pin).map_err(|e| pin_err(io::Error::other(e.to_string())))?;
    tracing::info!(program = name, interface, "attached (clsact filter; this kernel has no tcx)");
    Ok(())
}

/// The (program, interface, is-legacy) a pin under `links/` stands for, if it is a TC one.
fn parse_pin(file_name: &str) -> Option<(&'static str, TcAttachType, String, bool)> {
    let (legacy, rest) = match file_name.strip_prefix(LEGACY_PREFIX) {
        Some(rest) => (true, rest),
        None => (false, file_name),
    };
    let (program, interface) = rest.split_once('@')?;
    let (name, attach_type) = TC_PROGRAMS.into_iter().find(|(name, _)| *name == program)?;
    Some((name, attach_type, interface.to_owned(), legacy))
}

/// Removes the TC program behind `pin` from its interface (for a tcx link, unpinning does it).
/// Returns whether `pin` was a TC pin.
pub fn detach_pin(pin: &Path) -> io::Result<bool> {
    let Some((name, attach_type, interface, legacy)) = pin.file_name().and_then(|n| n.to_str()).and_then(parse_pin)
    else {
        return Ok(false);
    };
    if legacy {
        match tc::qdisc_detach_program(&interface, attach_type, name) {
            Ok(()) => {}
            Err(tc::TcError::IoError(e)) if e.kind() == io::ErrorKind::NotFound => {}
            // The interface is gone, and the filter with it.
            Err(tc::TcError::IoError(e)) if e.raw_os_error() == Some(libc::ENODEV) => {}
            Err(e) => return Err(io::Error::other(format!("detaching {name} from {interface}: {e}"))),
        }
    }
    fs::remove_file(pin)?;
    Ok(true)
}

fn detach_unlisted(links: &Path, interfaces: &[String]) -> Result<(), DatapathError> {
    let entries = fs::read_dir(links).map_err(|source| DatapathError::Bpffs { path: links.to_owned(), source })?;
    for entry in entries.flatten() {
        let path = entry.path();
        let Some((_, _, interface, _)) = entry.file_name().to_str().and_then(parse_pin) else { continue };
        if interfaces.contains(&interface) {
            continue;
        }
        detach_pin(&path).map_err(|source| DatapathError::Link { action: "detach", path: path.clone(), source })?;
        tracing::info!(pin = %path.display(), interface, "detached from an interface no longer in --interfaces");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_name_program_and_interface() {
        let (name, attach_type, interface, legacy) = parse_pin("epx_tc_ingress@eth0").unwrap();
        assert_eq!((name, attach_type, interface.as_str(), legacy), ("epx_tc_ingress", TcAttachType::Ingress, "eth0", false));
        let (name, _, interface, legacy) = parse_pin("legacy-tc:epx_tc_egress@veth-a@b").unwrap();
        assert_eq!((name, interface.as_str(), legacy), ("epx_tc_egress", "veth-a@b", true));
        assert!(parse_pin("epx_connect4").is_none());
        assert!(parse_pin("other@eth0").is_none());
    }

    #[test]
    fn none_turns_the_packet_path_off_and_a_list_is_taken_as_is() {
        assert!(resolve_interfaces(&["none".into()]).unwrap().is_empty());
        assert_eq!(resolve_interfaces(&["eth0".into(), "eth1".into()]).unwrap(), ["eth0", "eth1"]);
    }
}
