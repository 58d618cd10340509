//! Packet tests of the TC programs (`epx_tc_ingress`, `epx_tc_egress`) through
//! `BPF_PROG_TEST_RUN`: the built object, maps seeded here, one frame in, verdict and frame out.
//!
//! Expected frames are built from scratch with full checksums, so byte equality also proves the
//! programs' incremental checksum updates.

use std::net::{Ipv4Addr, SocketAddrV4};

use e2e::bpf_test_run::{
    be_addr, routed_netns, TcPrograms, EGRESS, INGRESS, NODE_LINK_MAC, OTHER_NODE_MAC, TC_ACT_OK, TC_ACT_REDIRECT,
};
use e2e::packet::{
    arp_request, icmp_error, read_ipv4, Frame, L4, CLIENT_MAC, ETH_HLEN, IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP,
    NODE_MAC, TCP_ACK, TCP_FIN, TCP_SYN,
};
use e2e::topology::in_netns;
use proxy_abi::{backend_flags, ct, maglev, svc_flags};

const CLIENT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(192, 168, 240, 2), 40000);
const NODE_PORT: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(192, 168, 240, 1), 30080);
const BACKEND_A: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 10), 8080);
const BACKEND_B: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 11), 8080);
const LOCAL: u8 = backend_flags::LOCAL;
/// A router on the client's side, and "fragmentation needed" with a next-hop MTU of 1400.
const ROUTER: Ipv4Addr = Ipv4Addr::new(192, 168, 240, 254);
const MTU_1400: [u8; 4] = [0, 0, 0x05, 0x78];

/// What the program must give back.
enum Expect {
    /// This verdict and exactly this frame.
    Frame(u32, Vec<u8>),
    /// TC_ACT_OK and the input frame, byte for byte.
    Untouched,
    /// An ICMP port unreachable from `NODE_PORT` to `CLIENT` quoting the input, redirected.
    PortUnreachable,
}

struct Case {
    description: &'static str,
    /// The frontend seeded before the run: (protocol, backends).
    seed: Option<(u8, &'static [(u32, SocketAddrV4, u8)])>,
    program: &'static str,
    input: Vec<u8>,
    expect: Expect,
    /// A counter that must read exactly 1 afterwards.
    counter: Option<&'static str>,
}

fn tcp_syn(dst: SocketAddrV4) -> Frame {
    Frame::tcp(CLIENT, dst, TCP_SYN)
}

/// Sets a raw byte of a built frame (for headers that lie).
fn patched(mut frame: Vec<u8>, at: usize, bytes: &[u8]) -> Vec<u8> {
    frame[at..at + bytes.len()].copy_from_slice(bytes);
    frame
}

fn cases() -> Vec<Case> {
    const ONE_TCP: Option<(u8, &[(u32, SocketAddrV4, u8)])> = Some((IPPROTO_TCP, &[(1, BACKEND_A, LOCAL)]));
    const ONE_UDP: Option<(u8, &[(u32, SocketAddrV4, u8)])> = Some((IPPROTO_UDP, &[(1, BACKEND_A, LOCAL)]));
    const NONE_TCP: Option<(u8, &[(u32, SocketAddrV4, u8)])> = Some((IPPROTO_TCP, &[]));
    const NONE_UDP: Option<(u8, &[(u32, SocketAddrV4, u8)])> = Some((IPPROTO_UDP, &[]));
    let udp_no_csum = |dst| Frame { l4: L4::Udp { checksum: false }, ..Frame::udp(CLIENT, dst) };
    let with_options = |frame: Frame| Frame { ip_options: vec![1, 1, 1, 0], ..frame };
    let fragment = |frag_off| Frame { frag_off, ..Frame::udp(CLIENT, NODE_PORT) };
    let empty_syn = || Frame { payload: Vec::new(), ..tcp_syn(NODE_PORT) }.build();
    vec![
        Case {
            description: "TCP SYN to a NodePort is DNATed to its local backend, checksums fixed",
            seed: ONE_TCP,
            program: INGRESS,
            input: tcp_syn(NODE_PORT).build(),
            expect: Expect::Frame(TC_ACT_OK, tcp_syn(BACKEND_A).build()),
            counter: Some("tc_dnat"),
        },
        Case {
            description: "UDP to a NodePort is DNATed, UDP checksum fixed",
            seed: ONE_UDP,
            program: INGRESS,
            input: Frame::udp(CLIENT, NODE_PORT).build(),
            expect: Expect::Frame(TC_ACT_OK, Frame::udp(CLIENT, BACKEND_A).build()),
            counter: Some("tc_ct_new"),
        },
        Case {
            description: "UDP without checksum (0) is DNATed and its checksum stays 0",
            seed: ONE_UDP,
            program: INGRESS,
            input: udp_no_csum(NODE_PORT).build(),
            expect: Expect::Frame(TC_ACT_OK, udp_no_csum(BACKEND_A).build()),
            counter: Some("tc_dnat"),
        },
        Case {
            description: "IPv4 options: DNAT finds the L4 header after them and keeps them",
            seed: ONE_TCP,
            program: INGRESS,
            input: with_options(tcp_syn(NODE_PORT)).build(),
            expect: Expect::Frame(TC_ACT_OK, with_options(tcp_syn(BACKEND_A)).build()),
            counter: Some("tc_dnat"),
        },
        Case {
            description: "another port on the node address is not a frontend: untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: tcp_syn(SocketAddrV4::new(*NODE_PORT.ip(), 22)).build(),
            expect: Expect::Untouched,
            counter: None,
        },
        Case {
            description: "UDP to a TCP-only frontend port is not a frontend: untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: Frame::udp(CLIENT, NODE_PORT).build(),
            expect: Expect::Untouched,
            counter: None,
        },
        Case {
            description: "ARP passes untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: arp_request(*CLIENT.ip(), *NODE_PORT.ip()),
            expect: Expect::Untouched,
            counter: None,
        },
        // (A frame cut inside the IPv4 header cannot be fed in: BPF_PROG_TEST_RUN itself refuses
        // an IPv4 frame shorter than an IPv4 header with EINVAL.)
        Case {
            description: "truncated TCP header (8 of 20 bytes, lengths consistent) passes untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: patched(empty_syn()[..ETH_HLEN + 28].to_vec(), ETH_HLEN + 2, &28u16.to_be_bytes()),
            expect: Expect::Untouched,
            counter: Some("tc_bad_header"),
        },
        Case {
            description: "truncated UDP header (4 of 8 bytes) passes untouched",
            seed: ONE_UDP,
            program: INGRESS,
            input: patched(Frame::udp(CLIENT, NODE_PORT).build()[..ETH_HLEN + 24].to_vec(), ETH_HLEN + 2, &24u16.to_be_bytes()),
            expect: Expect::Untouched,
            counter: Some("tc_bad_header"),
        },
        Case {
            description: "IHL larger than the packet (60 bytes claimed, 40 there) passes untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: patched(empty_syn(), ETH_HLEN, &[0x4f]),
            expect: Expect::Untouched,
            counter: Some("tc_bad_header"),
        },
        Case {
            description: "IHL below 5 passes untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: patched(empty_syn(), ETH_HLEN, &[0x44]),
            expect: Expect::Untouched,
            counter: Some("tc_bad_header"),
        },
        Case {
            description: "IPv4 total length beyond the frame passes untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: patched(empty_syn(), ETH_HLEN + 2, &1000u16.to_be_bytes()),
            expect: Expect::Untouched,
            counter: Some("tc_bad_header"),
        },
        Case {
            description: "TCP data offset below 5 passes untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: patched(empty_syn(), ETH_HLEN + 20 + 12, &[0x40]),
            expect: Expect::Untouched,
            counter: Some("tc_bad_header"),
        },
        Case {
            description: "non-first fragment to a frontend passes untouched (no ports to attribute)",
            seed: ONE_UDP,
            program: INGRESS,
            input: fragment(0x0010).build(),
            expect: Expect::Untouched,
            counter: Some("tc_fragment"),
        },
        Case {
            description: "first fragment (more-fragments set) is DNATed like any datagram of its flow",
            seed: ONE_UDP,
            program: INGRESS,
            input: fragment(0x2000).build(),
            expect: Expect::Frame(TC_ACT_OK, Frame { frag_off: 0x2000, ..Frame::udp(CLIENT, BACKEND_A) }.build()),
            counter: Some("tc_dnat"),
        },
        Case {
            description: "TCP SYN to a frontend without backends: ICMP port unreachable back out",
            seed: NONE_TCP,
            program: INGRESS,
            input: tcp_syn(NODE_PORT).build(),
            expect: Expect::PortUnreachable,
            counter: Some("tc_no_backend_reject"),
        },
        Case {
            description: "UDP to a frontend without backends: ICMP port unreachable back out",
            seed: NONE_UDP,
            program: INGRESS,
            input: Frame::udp(CLIENT, NODE_PORT).build(),
            expect: Expect::PortUnreachable,
            counter: Some("tc_no_backend_reject"),
        },
        Case {
            description: "an ICMP error about a flow nobody translated passes untouched",
            seed: ONE_TCP,
            program: INGRESS,
            input: icmp_error(ROUTER, *NODE_PORT.ip(), 3, 4, MTU_1400, &Frame::tcp(NODE_PORT, CLIENT, TCP_ACK).build()),
            expect: Expect::Untouched,
            counter: None,
        },
        Case {
            description: "egress: a packet of no tracked flow passes untouched",
            seed: ONE_TCP,
            program: EGRESS,
            input: Frame::tcp(BACKEND_A, CLIENT, TCP_SYN | TCP_ACK).build(),
            expect: Expect::Untouched,
            counter: None,
        },
    ]
}

fn check_port_unreachable(input: &[u8], output: &[u8]) -> Result<(), String> {
    let ip = read_ipv4(output).ok_or("not IPv4")?;
    let ok = output[0..6] == CLIENT_MAC
        && output[6..12] == NODE_MAC
        && ip.src == *NODE_PORT.ip()
        && ip.dst == *CLIENT.ip()
        && ip.proto == IPPROTO_ICMP
        && ip.ip_checksum_ok
        && ip.l4_checksum_ok
        && ip.l4[0..2] == [3, 3]
        && ip.l4[8..] == input[ETH_HLEN..ETH_HLEN + 28];
    if ok { Ok(()) } else { Err(format!("not the expected port unreachable: {ip:?}")) }
}

#[test]
fn single_packet_cases() {
    let mut failures = Vec::new();
    for case in cases() {
        let mut programs = TcPrograms::load().expect("loading the TC programs");
        if let Some((proto, backends)) = case.seed {
            programs.put_frontend(NODE_PORT, proto, 7, svc_flags::NODE_PORT, backends).expect("seeding");
        }
        let out = match programs.run(case.program, &case.input) {
            Ok(out) => out,
            Err(e) => {
                failures.push(format!("{}: {e:#}", case.description));
                continue;
            }
        };
        let result = match &case.expect {
            Expect::Frame(verdict, frame) if out.verdict == *verdict && out.frame == *frame => Ok(()),
            Expect::Frame(verdict, frame) => Err(format!(
                "want verdict {verdict} and\n  {frame:02x?}\ngot verdict {} and\n  {:02x?}",
                out.verdict, out.frame
            )),
            Expect::Untouched if out.verdict == TC_ACT_OK && out.frame == case.input => Ok(()),
            Expect::Untouched => Err(format!("changed: verdict {} frame {:02x?}", out.verdict, out.frame)),
            Expect::PortUnreachable if out.verdict == TC_ACT_REDIRECT => check_port_unreachable(&case.input, &out.frame),
            Expect::PortUnreachable => Err(format!("verdict {} instead of a redirect", out.verdict)),
        };
        let result = result.and_then(|()| match case.counter {
            Some(name) => match programs.counter(name).expect("counter") {
                1 => Ok(()),
                n => Err(format!("counter {name} is {n}, want 1")),
            },
            None => Ok(()),
        });
        if let Err(why) = result {
            failures.push(format!("{}: {why}", case.description));
        }
    }
    assert!(failures.is_empty(), "{} case(s) failed:\n{}", failures.len(), failures.join("\n\n"));
}

/// `frame` (IPv4) with its destination address replaced and the IP header checksum recomputed,
/// nothing else: what a translated later fragment (no L4 header) must look like.
fn with_ip_daddr(mut frame: Vec<u8>, daddr: Ipv4Addr) -> Vec<u8> {
    frame[ETH_HLEN + 16..ETH_HLEN + 20].copy_from_slice(&daddr.octets());
    e2e::packet::with_ipv4_checksum(frame)
}

#[test]
fn the_later_fragments_of_a_datagram_follow_its_first_fragment_to_the_backend() {
    let mut programs = TcPrograms::load().unwrap();
    programs.put_frontend(NODE_PORT, IPPROTO_UDP, 7, svc_flags::NODE_PORT, &[(1, BACKEND_A, LOCAL)]).unwrap();
    let first = Frame { frag_off: 0x2000, ip_id: 0x4242, ..Frame::udp(CLIENT, NODE_PORT) };
    let out = programs.run(INGRESS, &first.build()).unwrap();
    assert_eq!(out.frame, Frame { frag_off: 0x2000, ip_id: 0x4242, ..Frame::udp(CLIENT, BACKEND_A) }.build());
    // The next fragment (offset 16 bytes, more to come) and the last one: their bytes after the
    // IP header are data, untouched; only the destination (and the IP checksum) change.
    for frag_off in [0x2002, 0x0004] {
        let later = Frame { frag_off, ip_id: 0x4242, ..Frame::udp(CLIENT, NODE_PORT) }.build();
        let out = programs.run(INGRESS, &later).unwrap();
        assert_eq!((out.verdict, out.frame.clone()), (TC_ACT_OK, with_ip_daddr(later.clone(), *BACKEND_A.ip())), "fragment at {frag_off:#x}");
        let ip = read_ipv4(&out.frame).expect("IPv4");
        assert!(ip.ip_checksum_ok, "{ip:?}");
    }
    assert_eq!(programs.counter("tc_fragment_xlate").unwrap(), 2);
    // Another datagram's later fragment (another IP id) has no first fragment here: untouched.
    let stranger = Frame { frag_off: 0x0004, ip_id: 0x4343, ..Frame::udp(CLIENT, NODE_PORT) }.build();
    assert_eq!(programs.run(INGRESS, &stranger).unwrap().frame, stranger);
    assert_eq!(programs.counter("tc_fragment").unwrap(), 1);
}

#[test]
fn replies_of_a_translated_flow_leave_from_the_frontend() {
    let mut programs = TcPrograms::load().unwrap();
    programs.put_frontend(NODE_PORT, IPPROTO_TCP, 7, svc_flags::NODE_PORT, &[(1, BACKEND_A, LOCAL)]).unwrap();
    let syn = programs.run(INGRESS, &tcp_syn(NODE_PORT).build()).unwrap();
    assert_eq!(syn.frame, tcp_syn(BACKEND_A).build());

    // Both directions are tracked, each carrying the whole translation.
    let mut entries = programs.conntrack().unwrap();
    entries.sort_by_key(|(key, _)| key.dir);
    assert_eq!(entries.len(), 2, "{entries:?}");
    let (forward, reply) = (&entries[0], &entries[1]);
    assert_eq!((forward.0.dir, reply.0.dir), (ct::DIR_FORWARD, ct::DIR_REPLY));
    assert_eq!(Ipv4Addr::from(u32::from_be(forward.0.daddr_be)), *NODE_PORT.ip());
    assert_eq!(Ipv4Addr::from(u32::from_be(reply.0.saddr_be)), *BACKEND_A.ip());
    assert_eq!(u16::from_be(reply.0.dport_be), CLIENT.port());
    assert_eq!(forward.1.backend_id, 1);
    assert_eq!(forward.1.rev_nat_id, 7);
    assert_eq!(forward.1.state.tcp_seen, ct::TCP_SYN);

    let syn_ack = |src| Frame::tcp(src, CLIENT, TCP_SYN | TCP_ACK).build();
    let out = programs.run(EGRESS, &syn_ack(BACKEND_A)).unwrap();
    assert_eq!((out.verdict, out.frame), (TC_ACT_OK, syn_ack(NODE_PORT)), "the SYN-ACK must come from the NodePort");
    assert_eq!(programs.counter("tc_rev_nat").unwrap(), 1);

    // The same backend answering another client port is not this flow.
    let other = Frame::tcp(BACKEND_A, SocketAddrV4::new(*CLIENT.ip(), 40001), TCP_SYN | TCP_ACK).build();
    let out = programs.run(EGRESS, &other).unwrap();
    assert_eq!(out.frame, other);

    // A FIN from the backend moves the flow towards its closing timeout.
    programs.run(EGRESS, &Frame::tcp(BACKEND_A, CLIENT, TCP_FIN | TCP_ACK).build()).unwrap();
    let forward = programs.conntrack().unwrap().into_iter().find(|(k, _)| k.dir == ct::DIR_FORWARD).unwrap();
    assert_ne!(forward.1.state.tcp_seen & ct::TCP_FIN, 0, "{forward:?}");
}

#[test]
fn an_icmp_error_about_a_reply_reaches_the_backend_about_its_own_packet() {
    let mut programs = TcPrograms::load().unwrap();
    programs.put_frontend(NODE_PORT, IPPROTO_TCP, 7, svc_flags::NODE_PORT, &[(1, BACKEND_A, LOCAL)]).unwrap();
    programs.run(INGRESS, &tcp_syn(NODE_PORT).build()).unwrap();
    // A router towards the client cannot pass the (already translated) reply on without
    // fragmenting it: path-MTU discovery must reach the backend's socket.
    let reply_as_sent = Frame::tcp(NODE_PORT, CLIENT, TCP_ACK).build();
    let error = icmp_error(ROUTER, *NODE_PORT.ip(), 3, 4, MTU_1400, &reply_as_sent);
    let out = programs.run(INGRESS, &error).unwrap();
    let reply_as_backend_sent_it = Frame::tcp(BACKEND_A, CLIENT, TCP_ACK).build();
    let expected = icmp_error(ROUTER, *BACKEND_A.ip(), 3, 4, MTU_1400, &reply_as_backend_sent_it);
    assert_eq!((out.verdict, out.frame), (TC_ACT_OK, expected));
    assert_eq!(programs.counter("tc_icmp_error_xlate").unwrap(), 1);
}

/// Which backend a DNATed frame went to.
fn destination(frame: &[u8]) -> SocketAddrV4 {
    let ip = read_ipv4(frame).expect("IPv4");
    assert!(ip.ip_checksum_ok && ip.l4_checksum_ok, "bad checksums after DNAT: {ip:?}");
    SocketAddrV4::new(ip.dst, u16::from_be_bytes([ip.l4[2], ip.l4[3]]))
}

#[test]
fn an_established_flow_keeps_its_backend_when_the_backend_set_changes() {
    let mut programs = TcPrograms::load().unwrap();
    let both = [(1, BACKEND_A, LOCAL), (2, BACKEND_B, LOCAL)];
    programs.put_frontend(NODE_PORT, IPPROTO_TCP, 7, svc_flags::NODE_PORT, &both).unwrap();
    let first = destination(&programs.run(INGRESS, &tcp_syn(NODE_PORT).build()).unwrap().frame);
    let (kept, other) = if first == BACKEND_A { (both[0], both[1]) } else { (both[1], both[0]) };

    // The Service now has only the other backend (the first one still exists, e.g. draining).
    programs.put_frontend(NODE_PORT, IPPROTO_TCP, 7, svc_flags::NODE_PORT, &[other]).unwrap();
    for _ in 0..20 {
        let ack = programs.run(INGRESS, &Frame::tcp(CLIENT, NODE_PORT, TCP_ACK).build()).unwrap();
        assert_eq!(destination(&ack.frame), kept.1, "the established flow moved");
    }
    assert_eq!(programs.counter("tc_ct_hit").unwrap(), 20);
    // Even with the backend gone from the maps (its endpoint removed, the pod finishing its
    // connections), the connection stays where it is, as with kube-proxy's conntrack.
    programs.delete_backend(kept.0).unwrap();
    let ack = programs.run(INGRESS, &Frame::tcp(CLIENT, NODE_PORT, TCP_ACK).build()).unwrap();
    assert_eq!(destination(&ack.frame), kept.1, "the established flow moved after its backend was removed");
    // A new connection gets the new backend set.
    let new_client = SocketAddrV4::new(*CLIENT.ip(), 40001);
    let syn = programs.run(INGRESS, &Frame::tcp(new_client, NODE_PORT, TCP_SYN).build()).unwrap();
    assert_eq!(destination(&syn.frame), other.1);
    // So does a new connection reusing the old tuple (a bare SYN): it does not follow a removed backend.
    let syn = programs.run(INGRESS, &tcp_syn(NODE_PORT).build()).unwrap();
    assert_eq!(destination(&syn.frame), other.1);
}

#[test]
fn a_maglev_frontend_sends_each_flow_to_the_backend_its_table_names_for_the_flow_hash() {
    let mut programs = TcPrograms::load().unwrap();
    let backend_c = SocketAddrV4::new(Ipv4Addr::new(10, 244, 1, 12), 8080);
    let three = [(1, BACKEND_A, LOCAL), (2, BACKEND_B, LOCAL), (3, backend_c, LOCAL)];
    let flags = svc_flags::NODE_PORT | svc_flags::MAGLEV;
    programs.put_frontend(NODE_PORT, IPPROTO_TCP, 7, flags, &three).unwrap();
    // An irregular table (as Maglev's are), so a right answer cannot come from a pattern.
    let mut state = 12345u32;
    let table: Vec<u32> = (0..maglev::TABLE_SIZE)
        .map(|_| {
            state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            1 + (state >> 16) % 3
        })
        .collect();
    programs.put_maglev(7, &table).unwrap();

    let mut seen = [0u32; 3];
    for port in 20_000..20_060u16 {
        let client = SocketAddrV4::new(*CLIENT.ip(), port);
        let out = programs.run(INGRESS, &Frame::tcp(client, NODE_PORT, TCP_SYN).build()).unwrap();
        let hash = maglev::flow_hash(be_addr(&client), port.to_be(), NODE_PORT.port().to_be(), IPPROTO_TCP);
        let expected = table[maglev::slot(hash)];
        assert_eq!(destination(&out.frame), three[expected as usize - 1].1, "client port {port}");
        seen[expected as usize - 1] += 1;
    }
    assert!(seen.iter().all(|n| *n > 0), "60 flows should reach all three backends: {seen:?}");
    assert_eq!(programs.counter("tc_maglev_pick").unwrap(), 60);

    // The table missing (agent mid-update): a random slot still serves the flow, counted.
    programs.delete_maglev(7).unwrap();
    let client = SocketAddrV4::new(*CLIENT.ip(), 20_100);
    let out = programs.run(INGRESS, &Frame::tcp(client, NODE_PORT, TCP_SYN).build()).unwrap();
    assert!(three.iter().any(|b| b.1 == destination(&out.frame)));
    assert_eq!(programs.counter("tc_maglev_miss").unwrap(), 1);
}

#[test]
fn a_udp_flow_moves_when_its_backend_is_removed() {
    let mut programs = TcPrograms::load().unwrap();
    let both = [(1, BACKEND_A, LOCAL), (2, BACKEND_B, LOCAL)];
    programs.put_frontend(NODE_PORT, IPPROTO_UDP, 7, svc_flags::NODE_PORT, &both).unwrap();
    let request = Frame::udp(CLIENT, NODE_PORT).build();
    let first = destination(&programs.run(INGRESS, &request).unwrap().frame);
    for _ in 0..10 {
        assert_eq!(destination(&programs.run(INGRESS, &request).unwrap().frame), first);
    }
    let (gone, remaining) = if first == BACKEND_A { (both[0], both[1]) } else { (both[1], both[0]) };
    programs.put_frontend(NODE_PORT, IPPROTO_UDP, 7, svc_flags::NODE_PORT, &[remaining]).unwrap();
    programs.delete_backend(gone.0).unwrap();
    assert_eq!(destination(&programs.run(INGRESS, &request).unwrap().frame), remaining.1);
    // And the reply of the moved flow is translated from the new backend.
    let reply = Frame::udp(remaining.1, CLIENT).build();
    assert_eq!(programs.run(EGRESS, &reply).unwrap().frame, Frame::udp(NODE_PORT, CLIENT).build());
}

const REMOTE_BACKEND: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(10, 244, 2, 10), 8080);
#[test]
fn a_nodeport_flow_to_a_backend_on_another_node_is_snated_and_its_replies_return() {
    let ns = routed_netns().expect("routed namespace");
    in_netns(&ns.path(), || {
        let mut programs = TcPrograms::load().unwrap();
        programs.put_frontend(NODE_PORT, IPPROTO_TCP, 7, svc_flags::NODE_PORT, &[(1, REMOTE_BACKEND, 0)]).unwrap();
        let out = programs.run(INGRESS, &tcp_syn(NODE_PORT).build()).unwrap();
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "sent on by the program itself: {out:?}");
        let ip = read_ipv4(&out.frame).expect("IPv4");
        let snat_port = u16::from_be_bytes([ip.l4[0], ip.l4[1]]);
        assert!(
            snat_port >= ct::SNAT_PORT_MIN && !(ct::SNAT_SKIP_MIN..=ct::SNAT_SKIP_MAX).contains(&snat_port),
            "SNAT port {snat_port} must be outside the node's own ephemeral range"
        );
        let snated = SocketAddrV4::new(*NODE_PORT.ip(), snat_port);
        let routed = |frame: Frame| Frame { src_mac: NODE_LINK_MAC, dst_mac: OTHER_NODE_MAC, ..frame }.build();
        assert_eq!(out.frame, routed(Frame::tcp(snated, REMOTE_BACKEND, TCP_SYN)), "from the node address, to the other node");
        assert_eq!(programs.counter("tc_snat").unwrap(), 1);

        // The backend's answer comes to node:SNAT port and leaves as NodePort -> client.
        let answer = Frame::tcp(REMOTE_BACKEND, snated, TCP_SYN | TCP_ACK).build();
        let out = programs.run(INGRESS, &answer).unwrap();
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "{out:?}");
        assert_eq!(out.frame, routed(Frame::tcp(NODE_PORT, CLIENT, TCP_SYN | TCP_ACK)));
        assert_eq!(programs.counter("tc_snat_reply").unwrap(), 1);

        // The rest of the flow keeps backend and SNAT port; another client gets another port.
        let ack = programs.run(INGRESS, &Frame::tcp(CLIENT, NODE_PORT, TCP_ACK).build()).unwrap();
        assert_eq!(ack.frame, routed(Frame::tcp(snated, REMOTE_BACKEND, TCP_ACK)));
        let other_client = SocketAddrV4::new(Ipv4Addr::new(192, 168, 240, 3), CLIENT.port());
        let other = programs.run(INGRESS, &Frame::tcp(other_client, NODE_PORT, TCP_SYN).build()).unwrap();
        let other = read_ipv4(&other.frame).expect("IPv4");
        assert_ne!(u16::from_be_bytes([other.l4[0], other.l4[1]]), snat_port, "two flows on one SNAT port");

        // A router towards the other node needs smaller packets: the error reaches the client,
        // about the packet the client sent.
        let hop = Ipv4Addr::new(192, 168, 250, 2);
        let error = icmp_error(hop, *NODE_PORT.ip(), 3, 4, MTU_1400, &Frame::tcp(snated, REMOTE_BACKEND, TCP_ACK).build());
        let out = programs.run(INGRESS, &error).unwrap();
        let expected = icmp_error(hop, *CLIENT.ip(), 3, 4, MTU_1400, &Frame::tcp(CLIENT, NODE_PORT, TCP_ACK).build());
        assert_eq!((out.verdict, out.frame), (TC_ACT_OK, expected));

        // An externalIP comes from the address of the interface it arrived on: without one
        // recorded, DNAT only (counted); with one, SNAT to it.
        let external_ip = SocketAddrV4::new(Ipv4Addr::new(192, 168, 241, 10), 80);
        programs.put_frontend(external_ip, IPPROTO_TCP, 8, svc_flags::EXTERNAL_IP, &[(1, REMOTE_BACKEND, 0)]).unwrap();
        let out = programs.run(INGRESS, &tcp_syn(external_ip).build()).unwrap();
        assert_eq!((out.verdict, out.frame), (TC_ACT_OK, tcp_syn(REMOTE_BACKEND).build()));
        assert_eq!(programs.counter("tc_remote_backend_no_snat").unwrap(), 1);
        let interface_addr = Ipv4Addr::new(192, 168, 240, 1);
        programs.put_interface_address(1, interface_addr).unwrap();
        let next_client = SocketAddrV4::new(*CLIENT.ip(), CLIENT.port() + 1);
        let out = programs.run(INGRESS, &Frame::tcp(next_client, external_ip, TCP_SYN).build()).unwrap();
        assert_eq!(out.verdict, TC_ACT_REDIRECT, "{out:?}");
        let ip = read_ipv4(&out.frame).expect("IPv4");
        assert_eq!((ip.src, ip.dst), (interface_addr, *REMOTE_BACKEND.ip()), "{ip:?}");
        assert!(ip.ip_checksum_ok && ip.l4_checksum_ok, "{ip:?}");
    })
    .expect("running in the namespace");
}
