//! The node's own addresses, read from the kernel with getifaddrs(3) in the agent's network
//! namespace (the host's, for an agent with host networking). Read again before every
//! computation, so an address added or removed changes the NodePort frontends.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// Addresses of every interface except loopback ones, up or down (as kube-proxy's
/// `net.InterfaceAddrs`), sorted and without duplicates. IPv6 link-local addresses are left
/// out: every IPv6-enabled interface has one, so they would make any node look dual-stack, and
/// they mean nothing without their interface.
pub fn node_addresses() -> io::Result<Vec<IpAddr>> {
    let mut addrs: Vec<IpAddr> =
        interface_addresses()?.into_iter().map(|(_, addr)| addr).filter(|addr| is_node_address(*addr)).collect();
    addrs.sort();
    addrs.dedup();
    Ok(addrs)
}

/// (interface name, address) for every IPv4 and IPv6 address of a non-loopback interface.
pub fn interface_addresses() -> io::Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs allocates a list and points `head` at it; it is freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut found = Vec::new();
    let mut cursor = head;
    while !cursor.is_null() {
        // SAFETY: `cursor` is a node of the list getifaddrs returned, not freed yet.
        let entry = unsafe { &*cursor };
        cursor = entry.ifa_next;
        if entry.ifa_flags & libc::IFF_LOOPBACK as u32 != 0 || entry.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: `ifa_addr` is non-null and points at a sockaddr whose family says which
        // sockaddr_* it is; `ifa_name` is a NUL-terminated string owned by the list.
        let (addr, name) = unsafe {
            let addr = match i32::from((*entry.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(entry.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(entry.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
                }
                _ => continue,
            };
            (addr, std::ffi::CStr::from_ptr(entry.ifa_name).to_string_lossy().into_owned())
        };
        found.push((name, addr));
    }
    // SAFETY: `head` came from getifaddrs and is freed once; nothing points into it any more.
    unsafe { libc::freeifaddrs(head) };
    Ok(found)
}

pub fn is_node_address(addr: IpAddr) -> bool {
    match addr {
        IpAddr::V4(ip) => !ip.is_loopback() && !ip.is_unspecified(),
        IpAddr::V6(ip) => !ip.is_loopback() && !ip.is_unspecified() && !ip.is_unicast_link_local(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_and_link_local_are_not_node_addresses() {
        for skipped in ["127.0.0.1", "::1", "fe80::1", "0.0.0.0"] {
            assert!(!is_node_address(skipped.parse().unwrap()), "{skipped}");
        }
        for kept in ["10.244.1.1", "192.0.2.7", "fd00::1", "2001:db8::1"] {
            assert!(is_node_address(kept.parse().unwrap()), "{kept}");
        }
    }

    /// What getifaddrs gives, against iproute2's own netlink dump of the same namespace (an
    /// independent implementation): every global address, and nothing else.
    #[test]
    fn node_addresses_are_the_global_addresses_iproute2_lists() {
        let output = std::process::Command::new("ip").args(["-json", "address", "show"]).output().expect("running ip");
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        let links: serde_json::Value = serde_json::from_slice(&output.stdout).expect("ip's JSON");
        let mut expected: Vec<IpAddr> = links
            .as_array()
            .expect("a list of links")
            .iter()
            .flat_map(|link| link["addr_info"].as_array().cloned().unwrap_or_default())
            .filter(|a| a["scope"] == "global")
            .map(|a| a["local"].as_str().expect("local").parse().expect("an address"))
            .collect();
        let mut read = node_addresses().expect("getifaddrs");
        expected.sort();
        expected.dedup();
        read.sort();
        read.dedup();
        assert_eq!(read, expected);
    }
}
