//! IP parsing as Kubernetes does it.
//!
//! Go before 1.17 (and so the API server's validation) accepted IPv4 octets with leading zeros
//! and read them as decimal; such objects still exist in etcd. Rust's parser rejects them, and an
//! octal reading would send traffic elsewhere (CVE-2021-29923), so we parse them as decimal.

use std::net::{IpAddr, Ipv4Addr};

/// Parses an IP address the way kube-proxy reads it from the API (`netutils.ParseIPSloppy`).
pub fn parse_ip_sloppy(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(ip);
    }
    parse_ipv4_leading_zeros(text).map(IpAddr::V4)
}

/// Why `addr` can never be a Service or endpoint address, as the API server's validation says
/// (`ValidateNonSpecialIP`, `validateEndpointIP`): traffic to it never leaves the host it is
/// sent from, or is not one host's. None for an ordinary unicast address. An IPv4-mapped IPv6
/// address is judged as its IPv4 address.
pub fn special_address(addr: IpAddr) -> Option<&'static str> {
    let addr = addr.to_canonical();
    if addr.is_unspecified() {
        return Some("unspecified");
    }
    if addr.is_loopback() {
        return Some("loopback");
    }
    if addr.is_multicast() {
        return Some("multicast");
    }
    match addr {
        IpAddr::V4(v4) if v4.is_link_local() => Some("link-local"),
        IpAddr::V4(v4) if v4.is_broadcast() => Some("broadcast"),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some("link-local"),
        _ => None,
    }
}

fn parse_ipv4_leading_zeros(text: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = text.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *octet = part.parse().ok()?;
    }
    parts.next().is_none().then_some(Ipv4Addr::from(octets))
}

/// An IP network (`10.0.0.0/8`, `fd00::/64`): ipnet's.
pub type Cidr = ipnet::IpNet;

/// A CIDR as Kubernetes' `ParseCIDRSloppy` reads it: the address may have leading zeros (read
/// as decimal, see [`parse_ip_sloppy`]), the prefix is decimal digits only, and host bits are
/// masked off. None when it is no CIDR.
pub fn parse_cidr_sloppy(text: &str) -> Option<Cidr> {
    let (addr, prefix) = text.split_once('/')?;
    if prefix.is_empty() || prefix.len() > 3 || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(Cidr::new(parse_ip_sloppy(addr)?, prefix.parse().ok()?).ok()?.trunc())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_zeros_are_decimal_not_octal() {
        assert_eq!(parse_ip_sloppy("010.096.000.011"), Some("10.96.0.11".parse().unwrap()));
        assert_eq!(parse_ip_sloppy("10.96.0.10"), Some("10.96.0.10".parse().unwrap()));
        assert_eq!(parse_ip_sloppy("fd00::10"), Some("fd00::10".parse().unwrap()));
    }

    #[test]
    fn garbage_is_rejected() {
        for bad in ["", "10.96.0", "10.96.0.256", "10.96.0.1.2", " 10.96.0.1", "0x0a.0.0.1", "1111.0.0.1"] {
            assert_eq!(parse_ip_sloppy(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn cidrs_parse_mask_and_match_per_family() {
        let net = parse_cidr_sloppy("10.244.1.7/24").unwrap();
        assert_eq!(net.to_string(), "10.244.1.0/24");
        assert!(net.contains(&"10.244.1.1".parse::<IpAddr>().unwrap()));
        assert!(!net.contains(&"10.244.2.1".parse::<IpAddr>().unwrap()));
        assert!(!net.contains(&"fd00::1".parse::<IpAddr>().unwrap()));
        assert!(parse_cidr_sloppy("0.0.0.0/0").unwrap().contains(&"192.0.2.1".parse::<IpAddr>().unwrap()));
        assert!(parse_cidr_sloppy("fd00::/8").unwrap().contains(&"fd12::1".parse::<IpAddr>().unwrap()));
        assert_eq!(parse_cidr_sloppy("010.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
        for bad in ["10.0.0.0", "10.0.0.0/33", "fd00::/129", "10.0.0.0/", "/8", " 10.0.0.0/8", "10.0.0.0/8 ", "10.0.0.0/-1", "foo/8"] {
            assert_eq!(parse_cidr_sloppy(bad), None, "{bad:?}");
        }
    }
}
