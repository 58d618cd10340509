//! The node's own addresses, read from the kernel with getifaddrs(3) in the agent's network
//! namespace (the host's, for an agent with host networking). Read again before every
//! computation, and whenever the kernel announces an address change ([`AddressChanges`]), so an
//! address added or removed changes the NodePort frontends and the SNAT sources at once.

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

/// The kernel's announcements of IPv4 and IPv6 addresses added to or removed from any interface
/// of this network namespace (rtnetlink's `RTNLGRP_IPV4_IFADDR`/`RTNLGRP_IPV6_IFADDR`
/// multicast groups, as `ip monitor address`), through the rtnetlink crate.
pub struct AddressChanges {
    messages: futures::channel::mpsc::UnboundedReceiver<(
        rtnetlink::packet_core::NetlinkMessage<rtnetlink::packet_route::RouteNetlinkMessage>,
        rtnetlink::sys::SocketAddr,
    )>,
    connection: tokio::task::JoinHandle<()>,
}

impl AddressChanges {
    /// Subscribes; must be called inside the tokio runtime (the netlink socket is read by a
    /// task of its own).
    pub fn subscribe() -> io::Result<Self> {
        use rtnetlink::MulticastGroup;
        let (connection, _handle, messages) =
            rtnetlink::new_multicast_connection(&[MulticastGroup::Ipv4Ifaddr, MulticastGroup::Ipv6Ifaddr])?;
        Ok(Self { messages, connection: tokio::spawn(connection) })
    }

    /// Waits for the next announcement, then takes every one already queued with it (a burst,
    /// such as an interface coming up with several addresses, is one change). Pending forever
    /// once the netlink socket has failed: the caller's periodic re-read still catches changes.
    pub async fn next(&mut self) {
        use futures::StreamExt;
        if self.messages.next().await.is_none() {
            return std::future::pending().await;
        }
        while self.messages.try_recv().is_ok() {}
    }
}

impl Drop for AddressChanges {
    fn drop(&mut self) {
        self.connection.abort();
    }
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

    /// An address added to and removed from an interface is announced, each time. The test
    /// runs in a network namespace of its own (one thread enters it), with a veth
    /// pair there only.
    #[test]
    fn address_changes_are_announced() {
        let name = format!("epx-unit-netif-{}", std::process::id());
        let netns = std::path::PathBuf::from("/run/netns").join(&name);
        let ip = |args: &[&str]| {
            let output = std::process::Command::new("ip").args(args).output().expect("running ip");
            assert!(output.status.success(), "ip {args:?}: {}", String::from_utf8_lossy(&output.stderr));
        };
        ip(&["netns", "add", &name]);
        struct Cleanup(String);
        impl Drop for Cleanup {
            fn drop(&mut self) {
                let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).status();
            }
        }
        let _cleanup = Cleanup(name.clone());
        let in_ns = |args: &[&str]| {
            let mut all = vec!["-n", name.as_str()];
            all.extend_from_slice(args);
            ip(&all);
        };
        in_ns(&["link", "add", "d0", "type", "veth", "peer", "name", "d1"]);
        in_ns(&["link", "set", "d0", "up"]);
        let netns_file = std::fs::File::open(&netns).expect("the namespace");
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            // SAFETY: setns(2) on a namespace file held open; affects this thread only.
            assert_eq!(unsafe { libc::setns(netns_file.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            runtime.block_on(async {
                let mut changes = AddressChanges::subscribe().expect("subscribe");
                for (change, addr) in [("add", "192.0.2.7/24"), ("del", "192.0.2.7/24"), ("add", "2001:db8::7/64")] {
                    let output = std::process::Command::new("ip")
                        .args(["addr", change, addr, "dev", "d0"])
                        .output()
                        .expect("running ip");
                    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
                    tokio::time::timeout(std::time::Duration::from_secs(5), changes.next())
                        .await
                        .unwrap_or_else(|_| panic!("no announcement within 5 s of `ip addr {change} {addr}`"));
                    let now = node_addresses().expect("addresses");
                    let expected: IpAddr = addr.split('/').next().unwrap().parse().unwrap();
                    assert_eq!(now.contains(&expected), change == "add", "{change} {addr}: {now:?}");
                }
            });
        })
        .join()
        .expect("the test thread");
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
