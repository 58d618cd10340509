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
}
