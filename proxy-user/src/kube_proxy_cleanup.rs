//! `cleanup --kube-proxy`: removes what kube-proxy leaves on a node (as `kube-proxy --cleanup`),
//! so that switching to ebpf-proxy leaves no stale rule that would still DNAT or reject Service
//! traffic on the packet path.
//!
//! What is kube-proxy's, and nothing else is touched:
//! - iptables (IPv4 and IPv6, both the nf_tables and the legacy backend): every chain named
//!   `KUBE-*` in every table, and the rules of other chains that jump to one of them. Kept:
//!   kubelet's `KUBE-KUBELET-CANARY` and `KUBE-IPTABLES-HINT`, and, where kubelet runs (its
//!   canary exists), `KUBE-FIREWALL` and `KUBE-MARK-DROP`, which kubelet owns and kube-proxy only
//!   duplicates. (`kube-proxy --cleanup` itself leaves its canaries and a few chains behind.)
//! - nftables: the tables `ip kube-proxy` and `ip6 kube-proxy` (its nftables mode).
//! - IPVS, only when its `kube-ipvs0` device exists: the virtual services on the addresses bound
//!   to that device, the device, then the ipsets named `KUBE-*`. (kube-proxy flushes every
//!   virtual service; here one that is not on `kube-ipvs0` is someone else's and stays.)
//!
//! The tools, and why: iptables goes through `iptables-save`/`iptables-restore --noflush` (and
//! the `-nft`, `-legacy` and `ip6tables` variants) from Debian's `iptables` package, as kube-proxy
//! itself does: no Rust crate speaks the legacy x_tables interface, the `iptables` crate runs one
//! process per rule, and a restore applies a table's whole change atomically. nftables goes
//! through the `nftables` crate (nft's typed JSON API; Debian's `nftables` package). IPVS goes
//! through `ipvsadm` and `ipset` (Debian packages of those names), needed only when there is
//! IPVS state.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};

use nftables::schema::{NfCmd, NfListObject, NfObject, Nftables, Table};
use nftables::types::NfFamily;

/// kube-proxy's nftables table name (pkg/proxy/nftables: `kubeProxyTable`).
const NFT_TABLE: &str = "kube-proxy";
/// The dummy device the IPVS mode binds every Service address to.
const IPVS_DEVICE: &str = "kube-ipvs0";

#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error("running {}", program.display())]
    Spawn {
        program: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} {args} failed ({status}): {stderr}", program.display())]
    Failed { program: PathBuf, args: String, status: ExitStatus, stderr: String },
    #[error("nftables: {action}")]
    Nft {
        action: String,
        #[source]
        source: nftables::helper::NftablesError,
    },
    #[error("kube-proxy's IPVS device {IPVS_DEVICE} exists, but `{program}` is missing (install the Debian package {program})")]
    MissingTool { program: &'static str },
}

/// What was removed, one line each, for the operator.
#[derive(Debug, Default)]
pub struct Report {
    pub removed: Vec<String>,
}

impl Report {
    pub fn lines(&self) -> impl Iterator<Item = String> + '_ {
        let summary = match self.removed.len() {
            0 => "nothing of kube-proxy's was left".to_owned(),
            n => format!("{n} kube-proxy objects removed (iptables chains and jumps, nftables tables, IPVS state)"),
        };
        self.removed.iter().map(|line| format!("removed {line}")).chain(std::iter::once(summary))
    }
}

/// Removes kube-proxy's state from the current network namespace.
pub fn run() -> Result<Report, CleanupError> {
    let mut report = Report::default();
    // IPVS first: its iptables rules reference its ipsets, which go last.
    let ipvs = clean_ipvs(&mut report)?;
    for backend in iptables_backends() {
        clean_iptables(&backend, &mut report)?;
    }
    if ipvs {
        clean_ipsets(&mut report)?;
    }
    clean_nftables(&mut report)?;
    Ok(report)
}

/// One iptables-save/iptables-restore pair.
#[derive(Debug)]
struct Backend {
    save: PathBuf,
    restore: PathBuf,
}

/// The pairs installed: per family the `-nft` and `-legacy` ones (kube-proxy's image picks one
/// by which holds more rules, so either may hold its chains), else the plain one.
fn iptables_backends() -> Vec<Backend> {
    let mut backends = Vec::new();
    for family in ["iptables", "ip6tables"] {
        let mut found = false;
        for variant in ["-nft", "-legacy"] {
            if let (Some(save), Some(restore)) =
                (find_program(&format!("{family}{variant}-save")), find_program(&format!("{family}{variant}-restore")))
            {
                backends.push(Backend { save, restore });
                found = true;
            }
        }
        if !found {
            if let (Some(save), Some(restore)) = (find_program(&format!("{family}-save")), find_program(&format!("{family}-restore"))) {
                backends.push(Backend { save, restore });
            }
        }
    }
    backends
}

/// `name` on PATH or in the sbin directories (PATH of a DaemonSet often lacks them).
fn find_program(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

fn output(program: &Path, args: &[&str], stdin: Option<&str>) -> Result<String, CleanupError> {
    let spawn_error = |source| CleanupError::Spawn { program: program.to_owned(), source };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_error)?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(spawn_error)?;
    }
    let out = child.wait_with_output().map_err(spawn_error)?;
    if !out.status.success() {
        return Err(CleanupError::Failed {
            program: program.to_owned(),
            args: args.join(" "),
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn clean_iptables(backend: &Backend, report: &mut Report) -> Result<(), CleanupError> {
    let saved = output(&backend.save, &[], None)?;
    let plan = plan_iptables(&saved);
    if plan.restore.is_empty() {
        return Ok(());
    }
    output(&backend.restore, &["--noflush"], Some(&plan.restore))?;
    let tool = backend.save.file_name().map(|name| name.to_string_lossy().trim_end_matches("-save").to_owned()).unwrap_or_default();
    for (table, rule) in plan.jumps {
        report.removed.push(format!("{tool} -t {table} rule {rule}"));
    }
    for (table, chain) in plan.chains {
        report.removed.push(format!("{tool} -t {table} chain {chain}"));
    }
    Ok(())
}

/// What to remove from one `iptables-save` output, and the `iptables-restore --noflush` input
/// that does it.
#[derive(Debug, Default, PartialEq)]
struct IptablesPlan {
    /// (table, chain) removed.
    chains: Vec<(String, String)>,
    /// (table, rule as `-A CHAIN ...`) removed from chains that stay.
    jumps: Vec<(String, String)>,
    restore: String,
}

/// Per table: declare every kube-proxy chain (in a `--noflush` restore that flushes it, which
/// also drops the jumps between them), delete the jumps into them from other chains, then
/// delete the chains. One `COMMIT` per table: each table changes atomically.
fn plan_iptables(saved: &str) -> IptablesPlan {
    let kubelet = saved.lines().any(|line| line.trim() == ":KUBE-KUBELET-CANARY - [0:0]" || line.starts_with(":KUBE-KUBELET-CANARY "));
    let mut plan = IptablesPlan::default();
    let mut table: Option<String> = None;
    let mut chains: Vec<String> = Vec::new();
    let mut rules: Vec<(String, String)> = Vec::new();
    for line in saved.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('*') {
            table = Some(name.to_owned());
            chains.clear();
            rules.clear();
        } else if let Some(declaration) = line.strip_prefix(':') {
            if let Some(name) = declaration.split_whitespace().next() {
                chains.push(name.to_owned());
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            if let Some((chain, _)) = rule.split_once(' ') {
                rules.push((chain.to_owned(), line.to_owned()));
            }
        } else if line == "COMMIT" {
            if let Some(table) = table.take() {
                plan_table(&table, &chains, &rules, kubelet, &mut plan);
            }
        }
    }
    plan
}

fn plan_table(table: &str, chains: &[String], rules: &[(String, String)], kubelet: bool, plan: &mut IptablesPlan) {
    let doomed: BTreeSet<&str> =
        chains.iter().map(String::as_str).filter(|chain| is_kube_proxy_chain(chain, kubelet)).collect();
    if doomed.is_empty() {
        return;
    }
    let mut text = format!("*{table}\n");
    for chain in &doomed {
        text.push_str(&format!(":{chain} - [0:0]\n"));
    }
    for (chain, rule) in rules {
        if doomed.contains(chain.as_str()) {
            continue;
        }
        if jump_target(rule).is_some_and(|target| doomed.contains(target)) {
            // The same specification as saved deletes exactly that rule.
            text.push_str(&format!("-D {}\n", &rule["-A ".len()..]));
            plan.jumps.push((table.to_owned(), rule.clone()));
        }
    }
    for chain in &doomed {
        text.push_str(&format!("-X {chain}\n"));
        plan.chains.push((table.to_owned(), (*chain).to_owned()));
    }
    text.push_str("COMMIT\n");
    plan.restore.push_str(&text);
}

/// kube-proxy's chains: every `KUBE-*` chain but kubelet's.
fn is_kube_proxy_chain(chain: &str, kubelet: bool) -> bool {
    chain.starts_with("KUBE-")
        && !matches!(chain, "KUBE-KUBELET-CANARY" | "KUBE-IPTABLES-HINT")
        && !(kubelet && matches!(chain, "KUBE-FIREWALL" | "KUBE-MARK-DROP"))
}

/// The chain a saved rule jumps (`-j`) or goes (`-g`) to.
fn jump_target(rule: &str) -> Option<&str> {
    let mut words = rule.split_whitespace();
    while let Some(word) = words.next() {
        if matches!(word, "-j" | "--jump" | "-g" | "--goto") {
            return words.next();
        }
    }
    None
}

fn clean_nftables(report: &mut Report) -> Result<(), CleanupError> {
    // kube-proxy's nftables mode programs through `nft` itself: without it there is nothing.
    let Some(nft) = find_program("nft") else {
        return Ok(());
    };
    let nft = nft.as_os_str();
    let listed = nftables::helper::get_current_ruleset_with_args(Some(nft), ["list", "tables"])
        .map_err(|source| CleanupError::Nft { action: "listing the tables".into(), source })?;
    let tables: Vec<Table<'static>> = listed
        .objects
        .iter()
        .filter_map(|object| match object {
            NfObject::ListObject(NfListObject::Table(table))
                if table.name == NFT_TABLE && matches!(table.family, NfFamily::IP | NfFamily::IP6) =>
            {
                Some(Table { family: table.family, name: table.name.clone(), handle: None })
            }
            _ => None,
        })
        .collect();
    for table in tables {
        let family = match table.family {
            NfFamily::IP6 => "ip6",
            _ => "ip",
        };
        let batch = Nftables { objects: vec![NfObject::CmdObject(NfCmd::Delete(NfListObject::Table(table)))].into() };
        nftables::helper::apply_ruleset_with_args(&batch, Some(nft), std::iter::empty::<&str>())
            .map_err(|source| CleanupError::Nft { action: format!("deleting table {family} {NFT_TABLE}"), source })?;
        report.removed.push(format!("nftables table {family} {NFT_TABLE}"));
    }
    Ok(())
}

/// The IPVS mode's virtual services and device; true if there was IPVS state (then its ipsets
/// go after the iptables rules that use them).
fn clean_ipvs(report: &mut Report) -> Result<bool, CleanupError> {
    let name = CString::new(IPVS_DEVICE).expect("no NUL in the device name");
    // SAFETY: if_nametoindex reads a NUL-terminated string; it asks the current network namespace.
    if unsafe { libc::if_nametoindex(name.as_ptr()) } == 0 {
        return Ok(false);
    }
    let ip = find_program("ip").ok_or(CleanupError::MissingTool { program: "iproute2" })?;
    let bound = device_addresses(&output(&ip, &["-o", "addr", "show", "dev", IPVS_DEVICE], None)?);
    // Without the ip_vs module there are no virtual services to list.
    if Path::new("/sys/module/ip_vs").exists() {
        let ipvsadm = find_program("ipvsadm").ok_or(CleanupError::MissingTool { program: "ipvsadm" })?;
        let services = output(&ipvsadm, &["-S", "-n"], None)?;
        for (kind, service) in ipvs_services_on(&services, &bound) {
            output(&ipvsadm, &["-D", &kind, &service], None)?;
            report.removed.push(format!("IPVS virtual service {kind} {service}"));
        }
    }
    output(&ip, &["link", "delete", IPVS_DEVICE], None)?;
    report.removed.push(format!("device {IPVS_DEVICE}"));
    Ok(true)
}

/// The addresses in `ip -o addr show dev X` output.
fn device_addresses(text: &str) -> BTreeSet<IpAddr> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace().skip_while(|word| !matches!(*word, "inet" | "inet6"));
            words.next()?;
            words.next()?.split('/').next()?.parse().ok()
        })
        .collect()
}

/// The `(-t|-u|--sctp-service, ADDR:PORT)` of each virtual service in `ipvsadm -S -n` output
/// whose address is in `bound`.
fn ipvs_services_on(saved: &str, bound: &BTreeSet<IpAddr>) -> Vec<(String, String)> {
    saved
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            (words.next()? == "-A").then_some(())?;
            let kind = words.next()?;
            let service = words.next()?;
            matches!(kind, "-t" | "-u" | "--sctp-service").then_some(())?;
            let host = service.rsplit_once(':')?.0.trim_start_matches('[').trim_end_matches(']');
            bound.contains(&host.parse().ok()?).then(|| (kind.to_owned(), service.to_owned()))
        })
        .collect()
}

/// The IPVS mode's ipsets (all named `KUBE-*`), after the rules that used them are gone.
fn clean_ipsets(report: &mut Report) -> Result<(), CleanupError> {
    if !Path::new("/sys/module/ip_set").exists() {
        return Ok(());
    }
    let ipset = find_program("ipset").ok_or(CleanupError::MissingTool { program: "ipset" })?;
    for set in output(&ipset, &["list", "-n"], None)?.lines().map(str::trim).filter(|set| set.starts_with("KUBE-")) {
        output(&ipset, &["destroy", set], None)?;
        report.removed.push(format!("ipset {set}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shaped as kube-proxy v1.34's iptables mode writes it, with rules of others around.
    const SAVED: &str = r#"# Generated by iptables-nft-save v1.8.9 (nf_tables)
*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-PROXY-FIREWALL - [0:0]
:KUBE-SERVICES - [0:0]
:MINE - [0:0]
-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL
-A INPUT -p tcp --dport 22 -j MINE
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A MINE -j ACCEPT
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABC - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -s 10.0.0.0/8 -j MASQUERADE
-A KUBE-SERVICES -d 10.96.0.10/32 -p tcp -j KUBE-SVC-ABC
COMMIT
"#;

    #[test]
    fn removes_kube_chains_and_the_jumps_into_them_and_nothing_else() {
        let plan = plan_iptables(SAVED);
        let chains: Vec<String> = plan.chains.iter().map(|(t, c)| format!("{t}/{c}")).collect();
        assert_eq!(
            chains,
            [
                "mangle/KUBE-PROXY-CANARY",
                "filter/KUBE-FORWARD",
                "filter/KUBE-PROXY-FIREWALL",
                "filter/KUBE-SERVICES",
                "nat/KUBE-SERVICES",
                "nat/KUBE-SVC-ABC"
            ]
        );
        let jumps: Vec<&str> = plan.jumps.iter().map(|(_, rule)| rule.as_str()).collect();
        assert_eq!(
            jumps,
            [
                r#"-A INPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes load balancer firewall" -j KUBE-PROXY-FIREWALL"#,
                r#"-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD"#,
                r#"-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES"#,
            ]
        );
        assert!(!plan.restore.contains("MINE") && !plan.restore.contains("MASQUERADE"), "{}", plan.restore);
        assert!(plan.restore.contains("*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n-D PREROUTING"), "{}", plan.restore);
        assert_eq!(plan.restore.matches("COMMIT").count(), 3, "{}", plan.restore);
    }

    #[test]
    fn kubelets_chains_stay() {
        let saved = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n:KUBE-KUBELET-CANARY - [0:0]\n:KUBE-SERVICES - [0:0]\n\
                     -A INPUT -j KUBE-FIREWALL\nCOMMIT\n*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
        let plan = plan_iptables(saved);
        assert_eq!(plan.chains, [("filter".to_owned(), "KUBE-SERVICES".to_owned())]);
        assert!(plan.jumps.is_empty());
        // Without kubelet, its KUBE-FIREWALL can only be kube-proxy's duplicate.
        let plan = plan_iptables("*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n");
        assert_eq!(plan.chains, [("filter".to_owned(), "KUBE-FIREWALL".to_owned())]);
    }

    #[test]
    fn nothing_of_kube_proxys_means_no_restore() {
        assert_eq!(plan_iptables("*filter\n:INPUT ACCEPT [0:0]\n-A INPUT -j ACCEPT\nCOMMIT\n"), IptablesPlan::default());
    }

    #[test]
    fn ipvs_services_on_kube_ipvs0_only() {
        let bound = device_addresses(
            "7: kube-ipvs0    inet 10.96.0.1/32 scope global kube-ipvs0\\       valid_lft forever preferred_lft forever\n\
             7: kube-ipvs0    inet6 fd00::10/128 scope global \\       valid_lft forever preferred_lft forever\n",
        );
        let saved = "-A -t 10.96.0.1:443 -s rr\n-a -t 10.96.0.1:443 -r 10.244.1.5:6443 -m -w 1\n\
                     -A -u [fd00::10]:53 -s rr\n-A -t 192.0.2.7:80 -s wlc\n-A -f 7 -s rr\n";
        assert_eq!(
            ipvs_services_on(saved, &bound),
            [("-t".to_owned(), "10.96.0.1:443".to_owned()), ("-u".to_owned(), "[fd00::10]:53".to_owned())]
        );
    }
}
