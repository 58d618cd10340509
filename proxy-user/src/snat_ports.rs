//! The SNAT source-port range the packet path draws from (`--snat-port-range`), minus the node's
//! own ephemeral range (`net.ipv4.ip_local_port_range`, which IPv6 sockets use too), so that a
//! SNATed flow never takes the tuple of a connection the node itself made. Only the setting is
//! here; the kernel searches the range (`tc::claim_snat_port`).

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

    fn len(self) -> u32 {
        u32::from(self.max) - u32::from(self.min) + 1
    }
}

/// The node's ephemeral port range, as the kernel reads it for this network namespace.
pub fn ephemeral_range() -> std::io::Result<PortRange> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")?;
    PortRange::parse(&text).map_err(std::io::Error::other)
}

/// The kernel's settings for `range` without the part `ephemeral` overlaps. The skipped part
/// must be one hole inside the range, so an ephemeral range that covers either end trims it
/// instead; an error when nothing is left.
pub fn datapath_config(range: PortRange, ephemeral: PortRange) -> Result<(DatapathConfig, u32), String> {
    let (mut min, mut max) = (range.min, range.max);
    let (mut skip_min, mut skip_max) = (ephemeral.min.max(min), ephemeral.max.min(max));
    if skip_min <= skip_max {
        if skip_min == min && skip_max == max {
            return Err(format!(
                "--snat-port-range {range} lies inside the node's ephemeral range {ephemeral} \
                 (net.ipv4.ip_local_port_range): no port is left for SNAT"
            ));
        }
        if skip_min == min {
            min = skip_max + 1;
            (skip_min, skip_max) = (1, 0);
        } else if skip_max == max {
            max = skip_min - 1;
            (skip_min, skip_max) = (1, 0);
        }
    } else {
        (skip_min, skip_max) = (1, 0);
    }
    let config = DatapathConfig { snat_port_min: min, snat_port_max: max, snat_skip_min: skip_min, snat_skip_max: skip_max, ..Default::default() };
    let count = config.snat_port_count();
    debug_assert_eq!(count, PortRange { min, max }.len() - if skip_min <= skip_max { PortRange { min: skip_min, max: skip_max }.len() } else { 0 });
    Ok((config, count))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(text: &str) -> PortRange {
        PortRange::parse(text).expect(text)
    }

    /// Every port the kernel can hand out for `config`, in index order.
    fn ports(config: &DatapathConfig) -> Vec<u16> {
        (0..config.snat_port_count()).map(|i| config.snat_port(i)).collect()
    }

    #[test]
    fn the_default_range_skips_the_kernels_default_ephemeral_range() {
        let (config, count) = datapath_config(range("1024-65535"), range("32768\t60999\n")).unwrap();
        assert_eq!(count, 36_280);
        let ports = ports(&config);
        assert_eq!((ports[0], ports[31_743], ports[31_744], *ports.last().unwrap()), (1024, 32_767, 61_000, 65_535));
        assert!(ports.windows(2).all(|w| w[0] < w[1]), "each port once, in order");
        assert!(!ports.iter().any(|p| (32_768..=60_999).contains(p)));
    }

    #[test]
    fn an_ephemeral_range_over_one_end_trims_the_range() {
        let (config, count) = datapath_config(range("50000-65535"), range("32768-60999")).unwrap();
        assert_eq!((count, ports(&config)[0]), (4_536, 61_000));
        let (config, count) = datapath_config(range("1024-40000"), range("32768-60999")).unwrap();
        assert_eq!((count, *ports(&config).last().unwrap()), (31_744, 32_767));
        let (_, count) = datapath_config(range("1024-2000"), range("32768-60999")).unwrap();
        assert_eq!(count, 977, "no overlap: the whole range");
    }

    #[test]
    fn a_range_inside_the_ephemeral_range_is_refused_by_name() {
        let error = datapath_config(range("40000-50000"), range("32768-60999")).unwrap_err();
        assert!(error.contains("40000-50000") && error.contains("32768-60999"), "{error}");
    }

    #[test]
    fn bad_ranges_are_refused() {
        for text in ["", "1024", "0-100", "2000-1000", "1-70000", "a-b", "1-2-3"] {
            assert!(PortRange::parse(text).is_err(), "{text:?}");
        }
    }
}
