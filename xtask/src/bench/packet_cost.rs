//! What one packet costs the TC ingress program, measured in the kernel with `BPF_PROG_TEST_RUN`:
//! the shipped build against the same programs built without aya-log's calls
//! (`EPX_EBPF_NO_LOG`). The connection rates are too noisy on a shared machine to show a few
//! nanoseconds per packet; these figures are not, and they show what logging on the failure
//! paths costs the paths that succeed (nothing: those never reach a log call).
//!
//! Each build is loaded with maps of its own in a namespace of known routing
//! (`bpf_test_run::routed_netns`); nothing is attached anywhere and no packet leaves.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::Path;

use anyhow::{bail, Context};
use e2e::bpf_test_run::{routed_netns, TcPrograms, INGRESS, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
use e2e::packet::{Frame, IPPROTO_TCP, TCP_ACK, TCP_SYN};
use proxy_abi::{backend_flags, svc_flags};

use super::report::PacketCost;

const CLIENT: Ipv4Addr = Ipv4Addr::new(192, 168, 240, 2);
const NODE: Ipv4Addr = Ipv4Addr::new(192, 168, 240, 1);
/// NodePorts to a backend on this node, on another node (10.244.2.0/24 is routed), and on a
/// network no route leads to.
const TO_LOCAL: u16 = 30080;
const TO_REMOTE: u16 = 30081;
const TO_NOWHERE: u16 = 30082;

/// Packets per case and round, each run once and timed alone (the kernel's `repeat` runs the
/// program again on the packet it already rewrote: a translated flow would be timed as
/// something else after its first run), and rounds.
const PACKETS: u16 = 4_000;
const ROUNDS: u16 = 7;

/// The paths measured: key, what the report calls it, the verdict the program must give.
pub const CASES: &[(&str, &str, u32)] = &[
    ("pass", "not a Service (most of a node's traffic): passes untouched", TC_ACT_OK),
    ("local_established", "NodePort, established flow, backend on this node: DNAT", TC_ACT_OK),
    ("local_new", "NodePort, new flow (SYN), backend on this node: lookup, backend pick, conntrack insert, DNAT", TC_ACT_OK),
    ("remote_established", "NodePort, established flow, backend on another node: DNAT + SNAT, route lookup, redirect", TC_ACT_REDIRECT),
    ("no_route", "failure path: no route to the backend (counted, logged, dropped); the first 500 after the programs load", TC_ACT_SHOT),
    ("no_route_ring_full", "the same failure path once the log ring is full (a flood nobody reads)", TC_ACT_SHOT),
];

/// Failure-path packets timed on freshly loaded programs: their log records fit the log ring
/// (128 KiB) with room to spare.
const FIRST_FAILURES: u16 = 500;

/// The builds compared: name, object.
pub fn builds() -> [(&'static str, std::path::PathBuf); 2] {
    [("shipped", crate::ebpf_object()), ("no-log", crate::no_log_object())]
}

/// Every case for both builds, the builds taking turns round by round; each figure is the
/// median of its rounds.
pub fn measure() -> anyhow::Result<Vec<PacketCost>> {
    let ns = routed_netns()?;
    e2e::topology::in_netns(&ns.path(), || -> anyhow::Result<Vec<PacketCost>> {
        let builds = builds();
        let mut loaded = Vec::new();
        for (name, object) in &builds {
            loaded.push((*name, object, seeded(object).with_context(|| format!("loading the {name} build ({})", object.display()))?));
        }
        let mut costs: Vec<PacketCost> = Vec::new();
        for round in 0..ROUNDS {
            for (build, object, programs) in &loaded {
                for (case, title, verdict) in CASES {
                    let timed = if *case == "no_route" {
                        // Loaded again, so that the log ring is empty (nothing reads it here).
                        time_case(&seeded(object)?, case, *verdict, round)
                    } else {
                        time_case(programs, case, *verdict, round)
                    };
                    let ns = timed.with_context(|| format!("{build} build: {title}"))?;
                    match costs.iter_mut().find(|c| c.case == *case && c.build == *build) {
                        Some(cost) => cost.samples.push(ns),
                        None => costs.push(PacketCost { case: (*case).into(), build: (*build).into(), ns: f64::NAN, samples: vec![ns] }),
                    }
                }
            }
        }
        for (build, _, programs) in &loaded {
            // The failure path really was the one measured.
            if programs.counter("tc_fib_fail")? == 0 {
                bail!("{build} build: the no-route case never failed its route lookup");
            }
        }
        for cost in &mut costs {
            cost.ns = median(&cost.samples);
        }
        Ok(costs)
    })?
}

/// A build loaded with the three NodePorts' frontends.
fn seeded(object: &Path) -> anyhow::Result<TcPrograms> {
    let mut programs = TcPrograms::load_object(object)?;
    let backend = |last: u8, third: u8| SocketAddrV4::new(Ipv4Addr::new(10, 244, third, last), 8080);
    for (port, id, address, flags) in
        [(TO_LOCAL, 1, backend(10, 1), backend_flags::LOCAL), (TO_REMOTE, 2, backend(10, 2), 0), (TO_NOWHERE, 3, backend(10, 9), 0)]
    {
        programs.put_frontend(SocketAddrV4::new(NODE, port), IPPROTO_TCP, id as u16, svc_flags::NODE_PORT, &[(id, address, flags)])?;
    }
    Ok(programs)
}

/// One case's time per packet in ns: the median of [`PACKETS`] single runs. Established flows
/// are opened by their SYN first, then the same packet of the flow runs each time; new flows are
/// distinct SYNs (a client port each, a new range per round).
fn time_case(programs: &TcPrograms, case: &str, verdict: u32, round: u16) -> anyhow::Result<f64> {
    let frame = |port: u16, client_port: u16, flags: u8| {
        Frame::tcp(SocketAddrV4::new(CLIENT, client_port), SocketAddrV4::new(NODE, port), flags).build()
    };
    let once = |input: &[u8]| -> anyhow::Result<f64> {
        let (got, took) = programs.time(INGRESS, input, 1)?;
        if got != verdict {
            bail!("verdict {got}, expected {verdict}: the path measured is not the one named");
        }
        Ok(took.as_nanos() as f64)
    };
    let same = |input: Vec<u8>| (0..PACKETS).map(|_| once(&input)).collect::<anyhow::Result<Vec<f64>>>();
    let times = match case {
        "pass" => same(frame(22, 40_000, TCP_ACK))?,
        "local_established" | "remote_established" => {
            let port = if case == "local_established" { TO_LOCAL } else { TO_REMOTE };
            once(&frame(port, 40_000, TCP_SYN))?;
            same(frame(port, 40_000, TCP_ACK))?
        }
        "local_new" => {
            let first = 1_024 + round * PACKETS;
            (first..first + PACKETS).map(|client_port| once(&frame(TO_LOCAL, client_port, TCP_SYN))).collect::<anyhow::Result<_>>()?
        }
        "no_route" => (0..FIRST_FAILURES).map(|_| once(&frame(TO_NOWHERE, 40_000, TCP_SYN))).collect::<anyhow::Result<_>>()?,
        "no_route_ring_full" => same(frame(TO_NOWHERE, 40_000, TCP_SYN))?,
        other => bail!("unknown case {other}"),
    };
    Ok(median(&times))
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    sorted.get(sorted.len() / 2).copied().unwrap_or(f64::NAN)
}
