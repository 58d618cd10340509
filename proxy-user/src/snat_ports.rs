//! The SNAT source-port range the packet path draws from (`--snat-port-range`), minus
//! - the node's own ephemeral range (`net.ipv4.ip_local_port_range`, which IPv6 sockets use
//!   too), so that a SNATed flow never takes the tuple of a connection the node itself made;
//! - the NodePort range (`--service-node-port-range`), so that no backend's reply is addressed
//!   to node address:NodePort, which a load balancer on the backend's side (our socket hooks, or
//!   kube-proxy) may take for a new connection to that NodePort and never send back.
//!
//! Only the setting is here; the kernel searches the range (`tc::claim_snat_port`).

use std::fmt;

use proxy_abi::DatapathConfig;

/// An inclusive range of ports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRange {
    pub min: u16,
    pub max: u16,
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.min, self.max)
    }
}

impl PortRange {
    /// `MIN-MAX` (as the flag takes it) or `MIN MAX` (as /proc prints it).
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut parts = text.trim().split(|c: char| c == '-' || c.is_whitespace()).filter(|p| !p.is_empty());
        let (Some(min), Some(max), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("invalid port range {text:?}: use MIN-MAX, e.g. 1024-65535"));
        };
        let port = |p: &str| p.parse::<u16>().map_err(|_| format!("invalid port {p:?} in range {text:?}"));
        let (min, max) = (port(min)?, port(max)?);
        if min == 0 || min > max {
            return Err(format!("invalid port range {text:?}: needs 1 <= MIN <= MAX"));
        }
        Ok(Self { min, max })
    }
}

/// The node's ephemeral port range, as the kernel reads it for this network namespace.
pub fn ephemeral_range() -> std::io::Result<PortRange> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?;
    PortRange::parse(&text).map_err(std::io::Error::other)
}

/// A range of ports the SNAT range must leave out, and what it is (for the error message).
#[derive(Clone, Copy, Debug)]
pub struct Excluded<'a> {
    pub ports: PortRange,
    pub what: &'a str,
}

/// The kernel's settings for `range` without the ports of `excluded` (at most two ranges: the
/// node's ephemeral range and the NodePort range). What lies at either end of the range trims
/// it; what lies inside becomes one of the kernel's two skips (ranges that overlap or meet are
/// one skip). An error naming the ranges when nothing is left.
pub fn datapath_config(range: PortRange, excluded: &[Excluded]) -> Result<(DatapathConfig, u32), String> {
    let (mut min, mut max) = (u32::from(range.min), u32::from(range.max));
    // The excluded ports inside the range, sorted, overlapping or adjacent ones merged.
    let mut clipped: Vec<(u32, u32)> = excluded
        .iter()
        .map(|e| (u32::from(e.ports.min).max(min), u32::from(e.ports.max).min(max)))
        .filter(|(lo, hi)| lo <= hi)
        .collect();
    clipped.sort_unstable();
    let mut skips: Vec<(u32, u32)> = Vec::new();
    for (lo, hi) in clipped {
        match skips.last_mut() {
            Some(last) if lo <= last.1 + 1 => last.1 = last.1.max(hi),
            _ => skips.push((lo, hi)),
        }
    }
    if skips.first().is_some_and(|&(lo, hi)| lo == min && hi == max) {
        let names: Vec<String> = excluded.iter().map(|e| format!("{} {}", e.what, e.ports)).collect();
        return Err(format!("--snat-port-range {range} lies inside {}: no port is left for SNAT", names.join(" and ")));
    }
    if skips.first().is_some_and(|&(lo, _)| lo == min) {
        min = skips.remove(0).1 + 1;
    }
    if skips.last().is_some_and(|&(_, hi)| hi == max) {
        max = skips.pop().expect("just seen").0 - 1;
    }
    let skip = |i: usize| skips.get(i).map_or((1, 0), |&(lo, hi)| (lo as u16, hi as u16));
    if skips.len() > 2 {
        return Err(format!("--snat-port-range {range}: more than two excluded ranges inside it ({excluded:?})"));
    }
    let ((skip_min, skip_max), (skip2_min, skip2_max)) = (skip(0), skip(1));
    let config = DatapathConfig {
        snat_port_min: min as u16,
        snat_port_max: max as u16,
        snat_skip_min: skip_min,
        snat_skip_max: skip_max,
        snat_skip2_min: skip2_min,
        snat_skip2_max: skip2_max,
        ..Default::default()
    };
    let count = config.snat_port_count();
    debug_assert_eq!(count, max - min + 1 - skips.iter().map(|(lo, hi)| hi - lo + 1).sum::<u32>());
    Ok((config, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(text: &str) -> PortRange {
        PortRange::parse(text).expect(text)
    }

    /// The node's ephemeral range `ephemeral` and the NodePort range `node_ports`.
    fn excluded(ephemeral: &str, node_ports: &str) -> [Excluded<'static>; 2] {
        [
            Excluded { ports: range(ephemeral), what: "the node's ephemeral range" },
            Excluded { ports: range(node_ports), what: "the NodePort range" },
        ]
    }

    /// Every port the kernel can hand out for `config`, in index order.
    fn ports(config: &DatapathConfig) -> Vec<u16> {
        (0..config.snat_port_count()).map(|i| config.snat_port(i)).collect()
    }

    /// `ports` is every port of `range` outside `excluded`, each once, in order.
    fn assert_exactly(config: &DatapathConfig, range: &str, excluded: &[&str]) {
        let excluded: Vec<PortRange> = excluded.iter().map(|e| self::range(e)).collect();
        let range = self::range(range);
        let expected: Vec<u16> =
            (range.min..=range.max).filter(|p| !excluded.iter().any(|e| (e.min..=e.max).contains(p))).collect();
        assert_eq!(ports(config), expected);
    }

    #[test]
    fn the_default_range_skips_the_kernels_default_ephemeral_range_and_the_node_port_range() {
        let (config, count) = datapath_config(range("1024-65535"), &excluded("32768\t60999\n", "30000-32767")).unwrap();
        assert_eq!(count, 33_512);
        assert_exactly(&config, "1024-65535", &["32768-60999", "30000-32767"]);
        let ports = ports(&config);
        assert_eq!((ports[0], ports[28_975], ports[28_976], *ports.last().unwrap()), (1024, 29_999, 61_000, 65_535));
        // The kernel's defaults, when the agent has written nothing, are the same ports.
        assert_eq!(self::ports(&DatapathConfig::default()), ports);
    }

    #[test]
    fn two_separate_exclusions_are_two_skips() {
        let (config, count) = datapath_config(range("1024-65535"), &excluded("40000-50000", "30000-32767")).unwrap();
        assert_eq!(count, 64_512 - 10_001 - 2_768);
        assert_eq!((config.snat_skip_min, config.snat_skip2_min), (30_000, 40_000));
        assert_exactly(&config, "1024-65535", &["40000-50000", "30000-32767"]);
    }

    #[test]
    fn an_exclusion_over_one_end_trims_the_range() {
        let (config, count) = datapath_config(range("50000-65535"), &excluded("32768-60999", "30000-32767")).unwrap();
        assert_eq!((count, ports(&config)[0]), (4_536, 61_000));
        let (config, count) = datapath_config(range("1024-40000"), &excluded("32768-60999", "30000-32767")).unwrap();
        assert_eq!((count, *ports(&config).last().unwrap()), (28_976, 29_999));
        assert_exactly(&config, "1024-40000", &["32768-60999", "30000-32767"]);
        let (config, count) = datapath_config(range("1024-2000"), &excluded("32768-60999", "30000-32767")).unwrap();
        assert_eq!(count, 977, "no overlap: the whole range");
        assert_exactly(&config, "1024-2000", &[]);
        let (config, _) = datapath_config(range("29000-62000"), &excluded("32768-60999", "30000-32767")).unwrap();
        assert_exactly(&config, "29000-62000", &["30000-60999"]);
    }

    #[test]
    fn a_range_inside_the_exclusions_is_refused_by_name() {
        let error = datapath_config(range("40000-50000"), &excluded("32768-60999", "30000-32767")).unwrap_err();
        assert!(error.contains("40000-50000") && error.contains("32768-60999"), "{error}");
        let error = datapath_config(range("30091-30091"), &excluded("32768-60999", "30000-32767")).unwrap_err();
        assert!(error.contains("NodePort range 30000-32767"), "{error}");
        let error = datapath_config(range("30000-40000"), &excluded("32768-60999", "30000-32767")).unwrap_err();
        assert!(error.contains("no port is left"), "the two together cover it: {error}");
    }

    #[test]
    fn bad_ranges_are_refused() {
        for text in ["", "1024", "0-100", "2000-1000", "1-70000", "a-b", "1-2-3"] {
            assert!(PortRange::parse(text).is_err(), "{text:?}");
        }
    }
}
