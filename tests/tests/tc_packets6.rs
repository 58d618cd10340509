//! IPv6 packet tests of the TC programs through `BPF_PROG_TEST_RUN`, as `tc_packets.rs` does
//! for IPv4: frames built from scratch (full checksums), maps seeded here, verdict and frame out.

use std::net::{Ipv6Addr, SocketAddrV6};

use e2e::bpf_test_run::{TcPrograms, EGRESS, INGRESS, NODE_LINK_MAC, OTHER_NODE_MAC, TC_ACT_OK, TC_ACT_REDIRECT};
use e2e::packet::{IPPROTO_TCP, IPPROTO_UDP, TCP_ACK, TCP_SYN};
use e2e::packet6::{icmp6_error, neighbour_solicitation, read_ipv6, Ext, Frame6, IPPROTO_ICMPV6};
use e2e::topology::{in_netns, Netns};
use proxy_abi::{backend_flags, ct, svc_flags};

fn addr(ip: &str, port: u16) -> SocketAddrV6 {
    SocketAddrV6::new(ip.parse().expect("IPv6"), port, 0, 0)
}

fn client() -> SocketAddrV6 {
    addr("fd00:192:168:240::2", 40000)
}
fn node_port() -> SocketAddrV6 {
    addr("fd00:192:168:240::1", 30080)
}
fn backend_a() -> SocketAddrV6 {
    addr("fd00:10:244:1::10", 8080)
}
fn backend_b() -> SocketAddrV6 {
    addr("fd00:10:244:1::11", 8080)
}
const LOCAL: u8 = backend_flags::LOCAL;

/// Programs with one NodePort frontend (TCP and UDP) whose only backend is A.
fn with_backend_a() -> TcPrograms {
    let mut programs = TcPrograms::load().expect("load");
    let flags = svc_flags::NODE_PORT;
    programs.put_frontend6(node_port(), IPPROTO_TCP, 7, flags, &[(1, backend_a(), LOCAL)]).unwrap();
    programs.put_frontend6(node_port(), IPPROTO_UDP, 8, flags, &[(1, backend_a(), LOCAL)]).unwrap();
    programs
}

#[test]
fn a_tcp_syn_and_a_udp_datagram_to_an_ipv6_node_port_are_dnated_with_correct_checksums() {
    let programs = with_backend_a();
    for input in [Frame6::tcp(client(), node_port(), TCP_SYN), Frame6::udp(client(), node_port())] {
        let out = programs.run(INGRESS, &input.build()).unwrap();
        let expected = Frame6 { dst: backend_a(), ..input.clone() };
        assert_eq!(out.verdict, TC_ACT_OK);
        assert_eq!(out.frame, expected.build(), "{input:?}");
    }
    assert_eq!(programs.counter("tc_dnat").unwrap(), 2);
    assert_eq!(programs.counter("tc_ct_new").unwrap(), 2);
}

#[test]
fn replies_leave_from_the_ipv6_frontend_and_the_flow_keeps_its_backend() {
    let mut programs = with_backend_a();
    let syn = programs.run(INGRESS, &Frame6::tcp(client(), node_port(), TCP_SYN).build()).unwrap();
    assert_eq!(syn.frame, Frame6::tcp(client(), backend_a(), TCP_SYN).build());
    // The backend answers; on egress the answer comes from the NodePort.
    let reply = programs.run(EGRESS, &Frame6::tcp(backend_a(), client(), TCP_SYN | TCP_ACK).build()).unwrap();
    assert_eq!(reply.frame, Frame6::tcp(node_port(), client(), TCP_SYN | TCP_ACK).build());
    assert_eq!(programs.counter("tc_rev_nat").unwrap(), 1);
    // B joins, A stays listed: the established flow stays on A.
    programs.put_frontend6(node_port(), IPPROTO_TCP, 7, svc_flags::NODE_PORT, &[(2, backend_b(), LOCAL)]).unwrap();
    for _ in 0..10 {
        let ack = programs.run(INGRESS, &Frame6::tcp(client(), node_port(), TCP_ACK).build()).unwrap();
        assert_eq!(ack.frame, Frame6::tcp(client(), backend_a(), TCP_ACK).build());
    }
    assert_eq!(programs.counter("tc_ct_hit").unwrap(), 10);
    let flows = programs.conntrack6().unwrap();
    assert_eq!(flows.len(), 2, "forward and reply entries: {flows:?}");
}

#[test]
fn extension_headers_before_tcp_are_skipped_and_later_fragments_follow_their_first_fragment() {
    let programs = with_backend_a();
    let input = Frame6::tcp(client(), node_port(), TCP_SYN).with_ext(Ext::DestOptions);
    let out = programs.run(INGRESS, &input.build()).unwrap();
    assert_eq!(out.frame, Frame6 { dst: backend_a(), ..input }.build(), "DNAT behind a destination options header");

    // A later fragment before its first one: nothing to follow, untouched.
    let later = Frame6::udp(client(), node_port()).with_ext(Ext::Fragment { offset: 3, more: false }).build();
    let out = programs.run(INGRESS, &later).unwrap();
    assert_eq!((out.verdict, &out.frame), (TC_ACT_OK, &later));
    assert_eq!(programs.counter("tc_fragment").unwrap(), 1);
    // The first fragment (after the Fragment header, the UDP header) is DNATed as its flow...
    let first = Frame6::udp(client(), node_port()).with_ext(Ext::Fragment { offset: 0, more: true });
    let out = programs.run(INGRESS, &first.build()).unwrap();
    assert_eq!((out.verdict, out.frame), (TC_ACT_OK, Frame6 { dst: backend_a(), ..first }.build()));
    // ...and the later one now follows it: only its destination changes (no L4 header in it,
    // no IPv6 header checksum).
    let out = programs.run(INGRESS, &later).unwrap();
    let mut expected = later.clone();
    expected[14 + 24..14 + 40].copy_from_slice(&backend_a().ip().octets());
    assert_eq!((out.verdict, out.frame), (TC_ACT_OK, expected));
    assert_eq!(programs.counter("tc_fragment_xlate").unwrap(), 1);
}

#[test]
fn truncated_and_lying_headers_and_neighbour_discovery_pass_untouched() {
    let programs = with_backend_a();
    let good = Frame6::tcp(client(), node_port(), TCP_SYN).build();
    let mut lying = good.clone();
    lying[14 + 4..14 + 6].copy_from_slice(&500u16.to_be_bytes());
    let truncated = good[..14 + 40 + 10].to_vec();
    for input in [lying, truncated] {
        let out = programs.run(INGRESS, &input).unwrap();
        assert_eq!((out.verdict, &out.frame), (TC_ACT_OK, &input));
    }
    assert_eq!(programs.counter("tc_bad_header").unwrap(), 2);
    let ns = neighbour_solicitation("fd00:192:168:240::2".parse().unwrap(), "fd00:192:168:240::1".parse().unwrap());
    let out = programs.run(INGRESS, &ns).unwrap();
    assert_eq!((out.verdict, &out.frame), (TC_ACT_OK, &ns));
    assert_eq!(programs.counter("tc_dnat").unwrap(), 0);
}

#[test]
fn an_ipv6_frontend_without_backends_answers_icmpv6_port_unreachable() {
    let mut programs = TcPrograms::load().unwrap();
    programs.put_frontend6(node_port(), IPPROTO_UDP, 9, svc_flags::NODE_PORT, &[]).unwrap();
    let input = Frame6::udp(client(), node_port()).build();
    let out = programs.run(INGRESS, &input).unwrap();
    assert_eq!(out.verdict, TC_ACT_REDIRECT);
    let reply = read_ipv6(&out.frame).expect("an IPv6 frame");
    assert_eq!((reply.src, reply.dst, reply.next), (*node_port().ip(), *client().ip(), IPPROTO_ICMPV6), "{reply:?}");
    assert!(reply.l4_checksum_ok, "ICMPv6 checksum: {reply:?}");
    assert_eq!(&reply.l4[..2], &[1, 4], "destination unreachable / port unreachable");
    assert_eq!(&reply.l4[8..], &input[14..14 + 48], "quotes the IPv6 header and the first 8 bytes of UDP");
    assert_eq!(programs.counter("tc_no_backend_reject").unwrap(), 1);
}

#[test]
fn a_packet_too_big_about_a_reply_reaches_the_backend_about_its_own_packet() {
    let programs = with_backend_a();
    programs.run(INGRESS, &Frame6::tcp(client(), node_port(), TCP_SYN).build()).unwrap();
    // The reply left as node_port -> client; a router on the way says it is too big (MTU 1280).
    let sent = Frame6::tcp(node_port(), client(), TCP_SYN | TCP_ACK).build();
    let router: Ipv6Addr = "fd00:192:168:240::fe".parse().unwrap();
    let mtu = 1280u32.to_be_bytes();
    let error = icmp6_error(router, *node_port().ip(), 2, 0, mtu, &sent);
    let out = programs.run(INGRESS, &error).unwrap();
    assert_eq!(out.verdict, TC_ACT_OK);
    let as_backend_sent = Frame6::tcp(backend_a(), client(), TCP_SYN | TCP_ACK).build();
    assert_eq!(out.frame, icmp6_error(router, *backend_a().ip(), 2, 0, mtu, &as_backend_sent));
    assert_eq!(programs.counter("tc_icmp_error_xlate").unwrap(), 1);
}

#[test]
fn an_ipv6_maglev_frontend_sends_each_flow_to_the_backend_its_table_names() {
    let mut programs = TcPrograms::load().unwrap();
    let both = [(1, backend_a(), LOCAL), (2, backend_b(), LOCAL)];
    programs.put_frontend6(node_port(), IPPROTO_UDP, 7, svc_flags::NODE_PORT | svc_flags::MAGLEV, &both).unwrap();
    // Slot parity decides: even -> A (1), odd -> B (2).
    let table: Vec<u32> = (0..proxy_abi::maglev::TABLE_SIZE).map(|i| 1 + i % 2).collect();
    programs.put_maglev(7, &table).unwrap();
    for port in 30_000..30_040u16 {
        let from = SocketAddrV6::new(*client().ip(), port, 0, 0);
        let out = programs.run(INGRESS, &Frame6::udp(from, node_port()).build()).unwrap();
        let hash = proxy_abi::maglev::flow_hash6(&e2e::bpf_test_run::words6(client().ip()), port.to_be(), 30080u16.to_be(), IPPROTO_UDP);
        let expected = if table[proxy_abi::maglev::slot(hash)] == 1 { backend_a() } else { backend_b() };
        assert_eq!(read_ipv6(&out.frame).unwrap().dst, *expected.ip(), "client port {port}");
    }
    assert_eq!(programs.counter("tc_maglev_pick").unwrap(), 40);
}

fn remote_backend() -> SocketAddrV6 {
    addr("fd00:10:244:2::10", 8080)
}

/// As `bpf_test_run::routed_netns`, for IPv6: a link fd00:192:168:250::1/64 (MAC 02:..:0a)
/// to "the other node" fd00:192:168:250::2 (MAC 02:..:0b, a permanent neighbour), the next hop
/// for that node's pods (fd00:10:244:2::/64) and, here, for the client's network too.
fn routed_netns6() -> Netns {
    let ns = Netns::create(&format!("{}-{}-fib6", e2e::PREFIX, e2e::unique_id())).expect("netns");
    for cmd in [
        "ip link add epxa address 02:00:00:00:00:0a type veth peer name epxb",
        "ip -6 addr add fd00:192:168:250::1/64 dev epxa nodad",
        "ip link set lo up",
        "ip link set epxa up",
        "ip link set epxb up",
        "ip -6 neigh replace fd00:192:168:250::2 lladdr 02:00:00:00:00:0b dev epxa nud permanent",
        "ip -6 route add fd00:10:244:2::/64 via fd00:192:168:250::2",
        "ip -6 route add fd00:192:168:240::/64 via fd00:192:168:250::2",
        "sysctl -qw net.ipv6.conf.all.forwarding=1",
    ] {
        ns.exec(&cmd.split(' ').collect::<Vec<_>>()).expect(cmd);
    }
    ns
}

#[test]
fn an_ipv6_node_port_flow_to_a_backend_on_another_node_is_snated_and_its_replies_and_errors_return() {
    let ns = routed_netns6();
    in_netns(&ns.path(), || {
        let mut programs = TcPrograms::load().unwrap();
        let far = [(1, remote_backend(), 0)];
        programs.put_frontend6(node_port(), IPPROTO_TCP, 7, svc_flags::NODE_PORT, &far).unwrap();
        let out = programs.run(INGRESS, &Frame6::tcp(client(), node_port(), TCP_SYN).build()).unwrap();
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "sent on by the program itself: {out:?}");
        let ip = read_ipv6(&out.frame).expect("IPv6");
        let snat_port = u16::from_be_bytes([ip.l4[0], ip.l4[1]]);
        assert!(
            snat_port >= ct::SNAT_PORT_MIN && !(ct::SNAT_SKIP_MIN..=ct::SNAT_SKIP_MAX).contains(&snat_port),
            "SNAT port {snat_port} must be outside the node's own ephemeral range"
        );
        let snated = SocketAddrV6::new(*node_port().ip(), snat_port, 0, 0);
        let routed = |frame: Frame6| Frame6 { src_mac: NODE_LINK_MAC, dst_mac: OTHER_NODE_MAC, ..frame }.build();
        assert_eq!(out.frame, routed(Frame6::tcp(snated, remote_backend(), TCP_SYN)), "from the node address, to the other node");
        assert_eq!(programs.counter("tc_snat").unwrap(), 1);

        // The backend's answer comes to node:SNAT port and leaves as NodePort -> client.
        let out = programs.run(INGRESS, &Frame6::tcp(remote_backend(), snated, TCP_SYN | TCP_ACK).build()).unwrap();
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "{out:?}");
        assert_eq!(out.frame, routed(Frame6::tcp(node_port(), client(), TCP_SYN | TCP_ACK)));
        assert_eq!(programs.counter("tc_snat_reply").unwrap(), 1);

        // The rest of the flow keeps backend and SNAT port.
        let ack = programs.run(INGRESS, &Frame6::tcp(client(), node_port(), TCP_ACK).build()).unwrap();
        assert_eq!(ack.frame, routed(Frame6::tcp(snated, remote_backend(), TCP_ACK)));

        // A router towards the other node needs smaller packets: the error reaches the client,
        // about the packet the client sent.
        let hop: Ipv6Addr = "fd00:192:168:250::2".parse().unwrap();
        let mtu = 1280u32.to_be_bytes();
        let error = icmp6_error(hop, *node_port().ip(), 2, 0, mtu, &Frame6::tcp(snated, remote_backend(), TCP_ACK).build());
        let out = programs.run(INGRESS, &error).unwrap();
        let expected = icmp6_error(hop, *client().ip(), 2, 0, mtu, &Frame6::tcp(client(), node_port(), TCP_ACK).build());
        assert_eq!((out.verdict, out.frame), (TC_ACT_OK, expected));
        assert_eq!(programs.counter("tc_icmp_error_xlate").unwrap(), 1);

        // An externalIP comes from the IPv6 address of the interface it arrived on: without one
        // recorded, DNAT only (counted); with one, SNAT to it.
        let external_ip = addr("fd00:192:168:241::10", 80);
        programs.put_frontend6(external_ip, IPPROTO_TCP, 8, svc_flags::EXTERNAL_IP, &far).unwrap();
        let input = Frame6::tcp(client(), external_ip, TCP_SYN);
        let out = programs.run(INGRESS, &input.build()).unwrap();
        assert_eq!((out.verdict, out.frame), (TC_ACT_OK, Frame6 { dst: remote_backend(), ..input }.build()));
        assert_eq!(programs.counter("tc_remote_backend_no_snat").unwrap(), 1);
        let interface_addr: Ipv6Addr = "fd00:192:168:240::1".parse().unwrap();
        // BPF_PROG_TEST_RUN runs the program on the loopback device, ifindex 1.
        programs.put_interface_address6(1, interface_addr).unwrap();
        let next_client = addr("fd00:192:168:240::2", 40001);
        let out = programs.run(INGRESS, &Frame6::tcp(next_client, external_ip, TCP_SYN).build()).unwrap();
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "{out:?}");
        let ip = read_ipv6(&out.frame).expect("IPv6");
        assert_eq!((ip.src, ip.dst), (interface_addr, *remote_backend().ip()), "{ip:?}");
        assert!(ip.l4_checksum_ok, "{ip:?}");
    })
    .expect("running in the namespace");
}
