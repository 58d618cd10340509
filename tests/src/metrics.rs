//! Prometheus text (`/metrics` of the agent, kube-proxy, kube-apiserver) read with the
//! `prometheus-parse` crate.

use anyhow::Context;
pub use prometheus_parse::Scrape;

/// Parses one `/metrics` answer of `who`.
pub fn parse(text: &str, who: &str) -> anyhow::Result<Scrape> {
    Scrape::parse(text.lines().map(|line| Ok(line.to_owned()))).with_context(|| format!("parsing {who}'s /metrics"))
}

/// A counter's, gauge's or untyped sample's value (a histogram's `_sum` and `_count` are
/// untyped samples of their own); `None` for histogram buckets and summaries.
pub fn value(sample: &prometheus_parse::Sample) -> Option<f64> {
    match sample.value {
        prometheus_parse::Value::Counter(v) | prometheus_parse::Value::Gauge(v) | prometheus_parse::Value::Untyped(v) => Some(v),
        _ => None,
    }
}

/// The sum of every series of metric `name` whose labels `filter` accepts; `None` when there is
/// no such series (kube-proxy exports a histogram from its first observation only).
pub fn sum(scrape: &Scrape, name: &str, filter: impl Fn(&prometheus_parse::Labels) -> bool) -> Option<f64> {
    scrape.samples.iter().filter(|s| s.metric == name && filter(&s.labels)).filter_map(value).reduce(|a, b| a + b)
}
