//! Running `epx-probe` inside pods: backend servers, and clients that count answers and failures.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

use crate::topology::Topology;

/// What a client run saw. `failed` counts every request that did not get an answer.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    pub total: u32,
    pub ok: u32,
    pub failed: u32,
    /// Error name (ECONNREFUSED, TIMEOUT, ...) -> count.
    pub errors: BTreeMap<String, u32>,
    /// Name of the server that answered -> count.
    pub answers: BTreeMap<String, u32>,
    /// Each request's outcome in order: the answering server's name, or `error:NAME`
    /// (`tcp` and `udp` runs only).
    #[serde(default)]
    pub sequence: Vec<String>,
    pub elapsed_ms: u64,
}

impl Summary {
    pub fn answered_by(&self, name: &str) -> u32 {
        self.answers.get(name).copied().unwrap_or(0)
    }
    pub fn errors_of(&self, name: &str) -> u32 {
        self.errors.get(name).copied().unwrap_or(0)
    }
}

/// What `epx-probe load` saw: `clients` clients making `count` requests each. A TCP request
/// that failed is never retried. A UDP request is sent again on the same socket (the same flow,
/// as a DNS client does) when no answer came within a third of the timeout: a datagram lost on
/// a busy machine is not a failure, a flow the datapath lost is (`retried` counts the resends).
/// `failed_per_block[i]` counts the failures among the requests
/// `i * block .. (i + 1) * block` of every client, so a failure rate that grows with the number
/// of connections made so far shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Load {
    pub total: u32,
    pub ok: u32,
    pub failed: u32,
    pub errors: BTreeMap<String, u32>,
    pub answers: BTreeMap<String, u32>,
    pub block: u32,
    pub failed_per_block: Vec<u32>,
    #[serde(default)]
    pub retried: u32,
    pub elapsed_ms: u64,
    /// Requests per second over the whole run.
    pub per_second: f64,
}

impl Load {
    pub fn answered_by(&self, name: &str) -> u32 {
        self.answers.get(name).copied().unwrap_or(0)
    }
}

/// Runs `epx-probe load` with `command` (placed where the caller needs it): `clients` clients,
/// each making `count` `kind` (`tcp` or `udp`) requests to `to` at `rate` per second (0: as fast
/// as it goes). A request fails after 3 s without an answer: one lost SYN (retransmitted after
/// 1 s) is a delay, as for any real client; datapath drops are caught by its counters instead.
pub fn load(mut command: std::process::Command, kind: &str, to: &str, clients: u32, count: u32, rate: u32) -> anyhow::Result<Load> {
    let output = command
        .args(["load", "--kind", kind, "--to", to, "--timeout-ms", "3000"])
        .args(["--clients", &clients.to_string(), "--count", &count.to_string(), "--rate", &rate.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .context("running epx-probe load")?;
    if !output.status.success() {
        bail!("epx-probe load exited with {}", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(text.trim()).with_context(|| format!("parsing load output {text:?}"))
}

/// What `epx-probe rate` saw in its window: how many operations (short connections, or
/// request/response exchanges on one long-lived connection) completed, how fast, and their
/// latency percentiles. `failed` operations are counted, never retried.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Rate {
    /// `connect` (connect, read the answer, close) or `rr` (one connection, paced requests).
    pub mode: String,
    pub clients: u32,
    pub ok: u64,
    pub failed: u64,
    pub errors: BTreeMap<String, u64>,
    pub elapsed_ms: u64,
    /// Completed operations per second over the window.
    pub per_second: f64,
    /// Latency in microseconds: of `connect()` (SYN to established, the first-packet latency)
    /// in `connect` mode, of a request's answer in `rr` mode.
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

/// Runs `epx-probe rate` with `command` (placed where the caller needs it) against `to` for
/// `window`: `clients` threads of short connections, or (`rr_rate` given) one long-lived
/// connection with that many requests per second.
pub fn rate(mut command: std::process::Command, to: &str, clients: u32, window: std::time::Duration, rr_rate: Option<u32>) -> anyhow::Result<Rate> {
    command
        .args(["rate", "--to", to, "--clients", &clients.to_string()])
        .args(["--duration-ms", &window.as_millis().to_string()]);
    if let Some(rr) = rr_rate {
        command.args(["--rr-rate", &rr.to_string()]);
    }
    let output = command.stderr(Stdio::inherit()).output().context("running epx-probe rate")?;
    if !output.status.success() {
        bail!("epx-probe rate exited with {}", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(text.trim()).with_context(|| format!("parsing rate output {text:?}"))
}

/// What `epx-probe steady` saw: short TCP connections, UDP requests, and long-lived streams
/// (a stream counts as failed if it broke at any point).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Steady {
    pub tcp: Summary,
    pub udp: Summary,
    pub streams: Summary,
    /// Short TCP connections to a name looked up before each (`--tcp-name`; empty without).
    #[serde(default)]
    pub by_name: Summary,
}

impl Steady {
    pub fn failed(&self) -> u32 {
        self.tcp.failed + self.udp.failed + self.streams.failed + self.by_name.failed
    }
}

/// Steady traffic running in the background; `finish` waits for it and returns what it saw.
pub struct SteadyTraffic {
    child: Option<Child>,
}

impl SteadyTraffic {
    /// Starts `epx-probe steady` in `pod` against `tcp` and `udp` (`ip:port`) for `duration`.
    pub fn start(
        topology: &Topology,
        pod: &str,
        tcp: &str,
        udp: &str,
        rate: u32,
        streams: u32,
        duration: std::time::Duration,
    ) -> anyhow::Result<Self> {
        Self::start_with(topology.command_in(pod, &crate::bin("epx-probe"))?, tcp, udp, rate, streams, duration)
    }

    /// As [`SteadyTraffic::start`], with `command` (an `epx-probe` command placed wherever the
    /// caller needs it, e.g. [`crate::topology::ExternalClient::command`]).
    pub fn start_with(
        mut command: std::process::Command,
        tcp: &str,
        udp: &str,
        rate: u32,
        streams: u32,
        duration: std::time::Duration,
    ) -> anyhow::Result<Self> {
        let child = command
            .args(["steady", "--tcp", tcp, "--udp", udp])
            .args(["--rate", &rate.to_string(), "--streams", &streams.to_string()])
            .args(["--duration-ms", &duration.as_millis().to_string()])
            .stdout(Stdio::piped())
            .spawn()
            .context("spawning epx-probe steady")?;
        Ok(Self { child: Some(child) })
    }

    pub fn finish(mut self) -> anyhow::Result<Steady> {
        let output = self.child.take().expect("running").wait_with_output()?;
        if !output.status.success() {
            bail!("epx-probe steady exited with {}", output.status);
        }
        let text = String::from_utf8_lossy(&output.stdout);
        serde_json::from_str(text.trim()).with_context(|| format!("parsing steady output {text:?}"))
    }
}

impl Drop for SteadyTraffic {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A server process; killed on drop.
pub struct Server {
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `epx-probe serve` in `pod`, answering with `name` on the given ports, and waits
/// until it listens.
pub fn serve(topology: &Topology, pod: &str, name: &str, tcp: &[u16], udp: &[u16]) -> anyhow::Result<Server> {
    serve_with_peer(topology, pod, name, tcp, udp, &[])
}

/// As [`serve`], plus TCP ports `tcp_peer` on which the answer is `NAME from CLIENT_IP`: the
/// source address the backend saw (to tell SNAT from a preserved client address).
pub fn serve_with_peer(
    topology: &Topology,
    pod: &str,
    name: &str,
    tcp: &[u16],
    udp: &[u16],
    tcp_peer: &[u16],
) -> anyhow::Result<Server> {
    serve_ports(topology, pod, name, &[("--tcp", tcp), ("--udp", udp), ("--tcp-peer", tcp_peer)])
}

/// Starts `epx-probe serve` in `pod` with the given port flags (`--tcp`, `--udp`, `--tcp-peer`,
/// `--http`) and waits until it listens.
pub fn serve_ports(topology: &Topology, pod: &str, name: &str, ports: &[(&str, &[u16])]) -> anyhow::Result<Server> {
    let mut cmd = topology.command_in(pod, &crate::bin("epx-probe"))?;
    cmd.args(["serve", "--name", name]);
    for &(flag, ports) in ports {
        for port in ports {
            cmd.args([flag, &port.to_string()]);
        }
    }
    let mut child = cmd.stdout(Stdio::piped()).spawn().context("spawning epx-probe serve")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("stdout")?).read_line(&mut line)?;
    if line.trim() != "ready" {
        let _ = child.kill();
        bail!("epx-probe serve in {pod} did not start: {line:?}");
    }
    Ok(Server { child })
}

/// Runs a client (`tcp` or `udp`) in `pod` against `to` (`ip:port`) and returns its summary.
pub fn client(topology: &Topology, pod: &str, kind: &str, to: &str, count: u32) -> anyhow::Result<Summary> {
    client_with(topology.command_in(pod, &crate::bin("epx-probe"))?, kind, to, count)
}

/// As [`client`], with `command` (an `epx-probe` command placed wherever the caller needs it,
/// e.g. [`crate::topology::ExternalClient::command`]).
pub fn client_with(command: std::process::Command, kind: &str, to: &str, count: u32) -> anyhow::Result<Summary> {
    client_with_args(command, kind, to, count, &[])
}

/// [`client_with`] with more `epx-probe` options (e.g. `--source-port`).
pub fn client_with_args(
    mut command: std::process::Command,
    kind: &str,
    to: &str,
    count: u32,
    extra: &[&str],
) -> anyhow::Result<Summary> {
    let output = command
        .args([kind, "--to", to, "--count", &count.to_string()])
        .args(extra)
        .stderr(Stdio::inherit())
        .output()
        .context("running epx-probe")?;
    if !output.status.success() {
        bail!("epx-probe {kind} exited with {}", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(text.trim()).with_context(|| format!("parsing probe output {text:?}"))
}

/// The name of the server that answers one datagram of the UDP flow from `source_port` to `to`:
/// called again with the same port, it is the same flow (the same conntrack entry).
pub fn udp_flow_answer(command: std::process::Command, to: &str, source_port: u16) -> anyhow::Result<String> {
    let summary = client_with_args(command, "udp", to, 1, &["--source-port", &source_port.to_string()])?;
    match summary.sequence.as_slice() {
        [name] if summary.ok == 1 => Ok(name.clone()),
        _ => bail!("no answer from {to} to source port {source_port}: {summary:?}"),
    }
}

pub fn tcp(topology: &Topology, pod: &str, to: &str, count: u32) -> anyhow::Result<Summary> {
    client(topology, pod, "tcp", to, count)
}

pub fn udp(topology: &Topology, pod: &str, to: &str, count: u32) -> anyhow::Result<Summary> {
    client(topology, pod, "udp", to, count)
}
