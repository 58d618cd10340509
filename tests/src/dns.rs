//! A minimal DNS client (A records over UDP) and `/etc/resolv.conf` reading, for `epx-probe dns`:
//! a pod of the test image resolves names the way a pod's libc does (search domains, `ndots`)
//! through the cluster DNS, with nothing but this binary in its image.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::time::Duration;

const TYPE_A: u16 = 1;
const CLASS_IN: u16 = 1;
/// Header flags of a query: recursion desired.
const FLAGS_RD: u16 = 0x0100;
const HEADER_LEN: usize = 12;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("name {name:?} has an empty or over-long label")]
    BadName { name: String },
    #[error("answer truncated at byte {at}")]
    Truncated { at: usize },
    #[error("answer has id {got}, the query {want}")]
    WrongId { got: u16, want: u16 },
    #[error("server answered rcode {rcode} (3: no such name)")]
    Rcode { rcode: u8 },
    #[error("exchanging with {server}")]
    Io {
        server: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A standard query for the A records of `name`, with recursion desired.
pub fn query(name: &str, id: u16) -> Result<Vec<u8>, DnsError> {
    let mut packet = Vec::with_capacity(HEADER_LEN + name.len() + 6);
    packet.extend_from_slice(&id.to_be_bytes());
    packet.extend_from_slice(&FLAGS_RD.to_be_bytes());
    // One question, no answer, authority or additional records.
    packet.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(DnsError::BadName { name: name.to_owned() });
        }
        packet.push(label.len() as u8);
        packet.extend_from_slice(label.as_bytes());
    }
    packet.push(0);
    packet.extend_from_slice(&TYPE_A.to_be_bytes());
    packet.extend_from_slice(&CLASS_IN.to_be_bytes());
    Ok(packet)
}

/// The A records in the answer section of `packet`, the reply to query `id`. A reply without
/// any (NOERROR, no data) gives an empty list; NXDOMAIN and other failures an error.
pub fn a_records(packet: &[u8], id: u16) -> Result<Vec<Ipv4Addr>, DnsError> {
    let u16_at = |at: usize| -> Result<u16, DnsError> {
        packet.get(at..at + 2).map(|b| u16::from_be_bytes([b[0], b[1]])).ok_or(DnsError::Truncated { at })
    };
    let got = u16_at(0)?;
    if got != id {
        return Err(DnsError::WrongId { got, want: id });
    }
    let rcode = (u16_at(2)? & 0x000f) as u8;
    if rcode != 0 {
        return Err(DnsError::Rcode { rcode });
    }
    let (questions, answers) = (u16_at(4)?, u16_at(6)?);
    let mut at = HEADER_LEN;
    for _ in 0..questions {
        at = skip_name(packet, at)? + 4;
    }
    let mut records = Vec::new();
    for _ in 0..answers {
        at = skip_name(packet, at)?;
        let (kind, class, len) = (u16_at(at)?, u16_at(at + 2)?, usize::from(u16_at(at + 8)?));
        let data = packet.get(at + 10..at + 10 + len).ok_or(DnsError::Truncated { at })?;
        if kind == TYPE_A && class == CLASS_IN && len == 4 {
            records.push(Ipv4Addr::new(data[0], data[1], data[2], data[3]));
        }
        at += 10 + len;
    }
    Ok(records)
}

/// The offset after the (possibly compressed) name at `at`.
fn skip_name(packet: &[u8], mut at: usize) -> Result<usize, DnsError> {
    loop {
        let len = *packet.get(at).ok_or(DnsError::Truncated { at })?;
        match len {
            0 => return Ok(at + 1),
            // A compression pointer ends the name.
            len if len & 0xc0 == 0xc0 => return Ok(at + 2),
            len => at += 1 + usize::from(len),
        }
    }
}

/// Asks `server` for the A records of `name` over UDP.
pub fn resolve(server: SocketAddr, name: &str, timeout: Duration) -> Result<Vec<Ipv4Addr>, DnsError> {
    let id = (std::process::id() as u16) ^ 0x5a5a;
    let request = query(name, id)?;
    let io = |source| DnsError::Io { server, source };
    let socket = UdpSocket::bind("0.0.0.0:0").map_err(io)?;
    socket.set_read_timeout(Some(timeout)).map_err(io)?;
    socket.connect(server).map_err(io)?;
    socket.send(&request).map_err(io)?;
    let mut buf = [0u8; 1500];
    let len = socket.recv(&mut buf).map_err(io)?;
    a_records(&buf[..len], id)
}

/// What a pod's `/etc/resolv.conf` says (only what name lookup needs).
#[derive(Debug, Default, PartialEq)]
pub struct ResolvConf {
    pub nameservers: Vec<Ipv4Addr>,
    pub search: Vec<String>,
    pub ndots: usize,
}

impl ResolvConf {
    pub fn parse(text: &str) -> Self {
        let mut conf = ResolvConf { ndots: 1, ..Default::default() };
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match words.next() {
                Some("nameserver") => conf.nameservers.extend(words.next().and_then(|ip| ip.parse::<Ipv4Addr>().ok())),
                Some("search") => conf.search = words.map(str::to_owned).collect(),
                Some("options") => {
                    for option in words {
                        if let Some(n) = option.strip_prefix("ndots:").and_then(|n| n.parse().ok()) {
                            conf.ndots = n;
                        }
                    }
                }
                _ => {}
            }
        }
        conf
    }

    /// The names a lookup of `name` tries, in order, as glibc does: the search domains first when
    /// `name` has fewer than `ndots` dots, the name as given first otherwise; none for a name
    /// ending in a dot.
    pub fn candidates(&self, name: &str) -> Vec<String> {
        if let Some(absolute) = name.strip_suffix('.') {
            return vec![absolute.to_owned()];
        }
        let searched = self.search.iter().map(|domain| format!("{name}.{domain}"));
        if name.matches('.').count() < self.ndots {
            searched.chain([name.to_owned()]).collect()
        } else {
            [name.to_owned()].into_iter().chain(searched).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer as CoreDNS gives it: the question echoed, one A record named by a pointer to it.
    fn answer(id: u16, rcode: u8, ip: [u8; 4]) -> Vec<u8> {
        let mut packet = query("kube-dns.kube-system.svc.cluster.local", id).unwrap();
        packet[2] = 0x85;
        packet[3] = 0x80 | rcode;
        packet[7] = 1;
        packet.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
        packet.extend_from_slice(&ip);
        packet
    }

    #[test]
    fn a_query_and_its_answer() {
        let packet = query("a.bc.", 7).unwrap();
        assert_eq!(packet, [0, 7, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, b'a', 2, b'b', b'c', 0, 0, 1, 0, 1]);
        assert_eq!(a_records(&answer(7, 0, [10, 96, 0, 10]), 7).unwrap(), [Ipv4Addr::new(10, 96, 0, 10)]);
        assert!(matches!(a_records(&answer(7, 3, [0; 4]), 7), Err(DnsError::Rcode { rcode: 3 })));
        assert!(matches!(a_records(&answer(8, 0, [0; 4]), 7), Err(DnsError::WrongId { got: 8, want: 7 })));
        let cut = answer(7, 0, [1, 2, 3, 4]);
        assert!(matches!(a_records(&cut[..cut.len() - 2], 7), Err(DnsError::Truncated { .. })));
        assert!(query("a..b", 1).is_err());
    }

    #[test]
    fn search_domains_as_in_a_pod() {
        let conf = ResolvConf::parse(
            "search default.svc.cluster.local svc.cluster.local cluster.local\nnameserver 10.96.0.10\noptions ndots:5\n",
        );
        assert_eq!(conf.nameservers, [Ipv4Addr::new(10, 96, 0, 10)]);
        assert_eq!(conf.ndots, 5);
        assert_eq!(
            conf.candidates("echo"),
            ["echo.default.svc.cluster.local", "echo.svc.cluster.local", "echo.cluster.local", "echo"]
        );
        assert_eq!(conf.candidates("a.b.c.d.e.f")[0], "a.b.c.d.e.f");
        assert_eq!(conf.candidates("echo.default.svc.cluster.local."), ["echo.default.svc.cluster.local"]);
    }
}
