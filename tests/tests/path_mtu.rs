//! Path-MTU discovery through the node, for the packets the programs send on themselves (a
//! NodePort whose backend is on another node: DNAT and SNAT, then a redirect the kernel's
//! forwarding never sees). The node must act as the router it is: a packet larger than the next
//! link's MTU is answered with ICMP "fragmentation needed" (DF set) or ICMPv6 "packet too big",
//! from the address the sender sent to and quoting the packet as the sender sent it, so that the
//! sender's socket learns the path MTU and sends smaller packets. Without it, a TCP connection
//! whose segments do not fit stalls for good (the classic PMTU black hole).
//!
//! Two bottlenecks, each family:
//! - requests: the link to the other node is 1280 bytes while the backend advertises a TCP MSS
//!   for 1500 (a server behind a larger link, the small hop in the middle); the client's
//!   1400-byte DF datagram gets EMSGSIZE and a 1280 path MTU, and a 1400-byte TCP segment is
//!   resent smaller and echoed;
//! - replies: the link to the client is 1280 bytes; the backend's 1400-byte answers (sent with
//!   DF / over IPv6) get the ICMP error, and its next answer, fragmented, reaches the client.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::Duration;

use e2e::agent::{counter, Agent, AgentDir};
use e2e::probe::{self, Server};
use e2e::topology::{in_netns, ExternalClient, Topology, EXT_NODE_IP6};

const TCP_NODE_PORT: u16 = 30090;
const UDP_NODE_PORT: u16 = 30091;
const SMALL_MTU: u32 = 1280;
const LARGE: usize = 1400;

/// `far`, a NodePort Service (TCP 80 -> 8080 on 30090, UDP 53 -> 5353 on 30091) of `family`
/// whose only endpoint, `far_ip`, is on another node.
fn manifest(family: &str, cluster_ip: &str, far_ip: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: far, namespace: demo}}\nspec:\n  type: NodePort\n  ipFamilies: [{family}]\n  clusterIP: \"{cluster_ip}\"\n  ports:\n  - {{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {TCP_NODE_PORT}}}\n  - {{name: dns, port: 53, targetPort: 5353, protocol: UDP, nodePort: {UDP_NODE_PORT}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: far-a, namespace: demo, labels: {{kubernetes.io/service-name: far}}}}\naddressType: {family}\nendpoints: [{{addresses: [\"{far_ip}\"], nodeName: node-2}}]\nports:\n- {{name: http, port: 8080, protocol: TCP}}\n- {{name: dns, port: 5353, protocol: UDP}}\n"
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Bottleneck {
    /// The link between this node and the other one.
    Requests,
    /// The link between the client and this node.
    Replies,
}

struct Env {
    agent: Agent,
    client: ExternalClient,
    /// The NodePort address the client uses.
    node_ip: String,
    _server: Server,
    _dir: AgentDir,
    _topo: Topology,
}

impl Env {
    fn start(v6: bool, bottleneck: Bottleneck) -> Env {
        let mut topo = Topology::new().expect("topology");
        if v6 {
            topo.enable_ipv6().expect("IPv6 on the node");
        }
        let client = topo.add_external_client("ext").expect("external client");
        let (node_ip, back) = if v6 {
            topo.enable_external_ipv6(&client).expect("IPv6 on the client's link");
            (EXT_NODE_IP6.to_owned(), format!("{EXT_NODE_IP6}/128"))
        } else {
            (client.node_ip.clone(), format!("{}/32", client.node_ip))
        };
        let far = topo.add_remote_pod("far", 10, &[&back]).expect("remote pod");
        let far_ip = if v6 { far.ip6.clone().expect("IPv6 pod") } else { far.ip.clone() };
        let server = probe::serve(&topo, "far", "far", &[8080], &[5353]).expect("server on the other node");
        let mtu = SMALL_MTU.to_string();
        let far_netns = &topo.pod("far").netns;
        match bottleneck {
            Bottleneck::Requests => {
                topo.node.exec(&["ip", "link", "set", "n2", "mtu", &mtu]).expect("node side");
                far_netns.exec(&["ip", "link", "set", "eth0", "mtu", &mtu]).expect("other node side");
                // The backend advertises the MSS of a 1500-byte link, as a server whose own link
                // is larger than a hop on the way: only path-MTU discovery finds the 1280.
                let (ip, via, advmss) = if v6 { ("-6", "fd00:192:168:250::1", "1440") } else { ("-4", "192.168.250.1", "1460") };
                far_netns
                    .exec(&["ip", ip, "route", "change", &back, "via", via, "src", &far_ip, "advmss", advmss])
                    .expect("advmss on the backend's route back");
            }
            Bottleneck::Replies => {
                topo.node.exec(&["ip", "link", "set", &client.node_interface, "mtu", &mtu]).expect("node side");
                client.netns.exec(&["ip", "link", "set", "eth0", "mtu", &mtu]).expect("client side");
            }
        }
        let dir = AgentDir::new(&topo.id).expect("agent dir");
        let (family, cluster_ip) = if v6 { ("IPv6", "fd00:96::50") } else { ("IPv4", "10.96.0.50") };
        dir.write_manifest(&manifest(family, cluster_ip, &far_ip)).expect("manifest");
        let interfaces = format!("--interfaces={},n2", client.node_interface);
        let agent = Agent::start_file_in_node(&topo, &dir, &[&interfaces]).expect("agent");
        agent.wait_for_external_frontend(&node_ip, TCP_NODE_PORT);
        agent.wait_for_external_frontend(&node_ip, UDP_NODE_PORT);
        Env { agent, client, node_ip, _server: server, _dir: dir, _topo: topo }
    }

    fn to(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.node_ip.parse().expect("node address"), port)
    }

    /// Runs `f` in the client's namespace.
    fn in_client<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        in_netns(&self.client.netns.path(), f).expect("entering the client's namespace")
    }

    fn counters(&self) -> (u64, u64, u64) {
        let dump = self.agent.dump().expect("dump");
        (counter(&dump, "tc_frag_needed"), counter(&dump, "tc_too_big_drop"), counter(&dump, "tc_fib_fail"))
    }
}

/// Sets an integer socket option, or gets one (`value` None).
fn sockopt(fd: &impl AsRawFd, level: i32, name: i32, value: Option<i32>) -> std::io::Result<i32> {
    let mut v: libc::c_int = value.unwrap_or(0);
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let ptr = (&raw mut v).cast::<libc::c_void>();
    // SAFETY: a c_int-sized buffer and its length, on a socket we own.
    let rc = unsafe {
        match value {
            Some(_) => libc::setsockopt(fd.as_raw_fd(), level, name, ptr, len),
            None => libc::getsockopt(fd.as_raw_fd(), level, name, ptr, &mut len),
        }
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(v)
}

/// The path MTU the kernel holds for a connected socket (`IP_MTU`/`IPV6_MTU`).
fn path_mtu(fd: &impl AsRawFd, v6: bool) -> i32 {
    let (level, name) = if v6 { (libc::IPPROTO_IPV6, libc::IPV6_MTU) } else { (libc::IPPROTO_IP, libc::IP_MTU) };
    sockopt(fd, level, name, None).expect("reading the path MTU")
}

/// Requests larger than the link to the other node: a DF datagram gets "fragmentation needed"
/// (EMSGSIZE and the link's MTU on the socket), and a TCP segment too large is sent again in
/// pieces that fit and echoed. Each in a topology of its own: the path MTU one learns would
/// spare the other its ICMP error.
fn requests_learn_the_path_mtu(v6: bool) {
    let env = Env::start(v6, Bottleneck::Requests);
    let udp = env.to(UDP_NODE_PORT);
    let (error, mtu) = env.in_client(|| {
        let bind: SocketAddr = if v6 { "[::]:0".parse().unwrap() } else { "0.0.0.0:0".parse().unwrap() };
        let socket = UdpSocket::bind(bind).expect("bind");
        socket.connect(udp).expect("connect");
        let (level, name, value) = if v6 {
            (libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER, libc::IPV6_PMTUDISC_DO)
        } else {
            (libc::IPPROTO_IP, libc::IP_MTU_DISCOVER, libc::IP_PMTUDISC_DO)
        };
        sockopt(&socket, level, name, Some(value)).expect("DF on");
        socket.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
        socket.send(&[b'x'; LARGE]).expect("a datagram that fits the client's own link");
        let error = socket.recv(&mut [0u8; 2048]).expect_err("a 1400-byte datagram cannot cross a 1280-byte link");
        (error, path_mtu(&socket, v6))
    });
    assert_eq!(
        error.raw_os_error(),
        Some(libc::EMSGSIZE),
        "the client's socket hears 'fragmentation needed' / 'packet too big' from the node, got {error:?}; counters {:?}",
        env.counters()
    );
    assert_eq!(mtu, SMALL_MTU as i32, "the client learnt the next link's MTU");
    let (frag_needed, too_big_drop, fib_fail) = env.counters();
    assert_eq!((frag_needed, too_big_drop, fib_fail), (1, 0, 0), "one ICMP error, for the datagram");
    drop(env);

    let env = Env::start(v6, Bottleneck::Requests);
    let tcp = env.to(TCP_NODE_PORT);
    let (greeting, echoed, mss) = env.in_client(|| {
        let mut stream = TcpStream::connect_timeout(&tcp, Duration::from_secs(5)).expect("connect through the NodePort");
        stream.set_nodelay(true).expect("nodelay");
        stream.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut greeting = [0u8; 4];
        stream.read_exact(&mut greeting).expect("the backend's greeting");
        // One write smaller than the advertised MSS: one segment of 1400 bytes of data, larger
        // than the 1280-byte link (not a GSO packet, which the route lookup lets through).
        let data: Vec<u8> = (0..LARGE).map(|i| (i % 251) as u8).collect();
        stream.write_all(&data).expect("write");
        let mut echoed = vec![0u8; LARGE];
        let read = stream.read_exact(&mut echoed).map(|()| echoed == data);
        let mss = sockopt(&stream, libc::IPPROTO_TCP, libc::TCP_MAXSEG, None).expect("TCP_MAXSEG");
        (greeting, read, mss)
    });
    assert_eq!(&greeting, b"far\n");
    match echoed {
        Ok(same) => assert!(same, "the echo differs from what was sent"),
        Err(error) => panic!("a 1400-byte segment through a 1280-byte link was never echoed ({error}): a PMTU black hole; counters {:?}", env.counters()),
    }
    assert!(mss <= SMALL_MTU as i32 - if v6 { 60 } else { 40 }, "the connection's MSS came down to the path: {mss}");
    let (frag_needed, too_big_drop, fib_fail) = env.counters();
    assert!(frag_needed >= 1, "an ICMP error for the segment: {frag_needed}");
    assert_eq!((too_big_drop, fib_fail), (0, 0));
}

/// Answers larger than the link to the client: the backend hears "fragmentation needed" /
/// "packet too big" (from the node address it answers to, about the packet it sent) and its
/// next answer, fragmented, reaches the client.
fn replies_learn_the_path_mtu(v6: bool) {
    let env = Env::start(v6, Bottleneck::Replies);
    let udp = env.to(UDP_NODE_PORT);
    let answers = env.in_client(|| {
        let bind: SocketAddr = if v6 { "[::]:0".parse().unwrap() } else { "0.0.0.0:0".parse().unwrap() };
        let socket = UdpSocket::bind(bind).expect("bind");
        socket.connect(udp).expect("connect");
        socket.set_read_timeout(Some(Duration::from_secs(2))).expect("timeout");
        // Each request goes out in fragments (the client's own link is 1280) and asks for an
        // answer as large: the first answer is lost at the node, the ICMP error teaches the
        // backend, the later ones come fragmented.
        let mut answers = Vec::new();
        for _ in 0..5 {
            socket.send(&[b'q'; LARGE]).expect("send");
            let mut buf = [0u8; 2048];
            answers.push(socket.recv(&mut buf).map(|n| (n, buf[..3].to_vec())).map_err(|e| e.kind()));
        }
        answers
    });
    let answered: Vec<_> = answers.iter().flatten().collect();
    assert!(
        answered.len() >= 3 && answered.iter().all(|(n, name)| *n == LARGE && name == b"far"),
        "1400-byte answers over a 1280-byte link reach the client once the backend learnt the path MTU: {answers:?}; counters {:?}",
        env.counters()
    );
    let (frag_needed, too_big_drop, fib_fail) = env.counters();
    assert!(frag_needed >= 1, "the backend was told: {frag_needed}");
    assert_eq!((too_big_drop, fib_fail), (0, 0));
}

#[test]
fn ipv4_requests_too_big_for_the_link_to_the_other_node_get_fragmentation_needed() {
    requests_learn_the_path_mtu(false);
}

#[test]
fn ipv6_requests_too_big_for_the_link_to_the_other_node_get_packet_too_big() {
    requests_learn_the_path_mtu(true);
}

#[test]
fn ipv4_answers_too_big_for_the_link_to_the_client_teach_the_backend_the_path_mtu() {
    replies_learn_the_path_mtu(false);
}

#[test]
fn ipv6_answers_too_big_for_the_link_to_the_client_teach_the_backend_the_path_mtu() {
    replies_learn_the_path_mtu(true);
}
