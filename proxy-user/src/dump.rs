//! `ebpf-proxy dump`: what the kernel is using, read from the pinned maps alone (works while the
//! agent is stopped).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Context;
use serde::Serialize;

use crate::desired::Scope;
use crate::kernel::{self, KernelMaps};
use crate::lbmap::LbMaps;
use crate::reconcile::{decode_backend, decode_frontend};

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DumpedBackend {
    pub id: u32,
    pub ip: String,
    pub port: u16,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct DumpedService {
    pub ip: String,
    pub port: u16,
    pub protocol: String,
    pub scope: String,
    pub rev_nat_id: u16,
    pub backends: Vec<DumpedBackend>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Dump {
    pub services: Vec<DumpedService>,
    pub counters: BTreeMap<String, u64>,
    pub rev_sock_entries: usize,
}

pub fn collect(bpffs: &Path) -> anyhow::Result<Dump> {
    let maps = KernelMaps::open_pinned(bpffs)
        .with_context(|| format!("no datapath pinned under {} (is the agent installed there?)", bpffs.display()))?;
    let entries: BTreeMap<_, _> = maps.services()?.into_iter().collect();
    let backends: BTreeMap<_, _> = maps.backends()?.into_iter().collect();
    let mut services = Vec::new();
    for (key, value) in entries.iter().filter(|(k, _)| k.backend_slot == 0) {
        let Some(frontend) = decode_frontend(key) else { continue };
        let mut dumped = Vec::new();
        for slot in 1..=value.count {
            let slot_key = proxy_abi::ServiceKey4 { backend_slot: slot, ..*key };
            let Some(slot_value) = entries.get(&slot_key) else { continue };
            let id = slot_value.backend_id;
            if let Some(backend) = backends.get(&id).and_then(decode_backend) {
                dumped.push(DumpedBackend { id, ip: backend.addr.to_string(), port: backend.port });
            }
        }
        services.push(DumpedService {
            ip: frontend.addr.to_string(),
            port: frontend.port,
            protocol: frontend.proto.to_string(),
            scope: match frontend.scope {
                Scope::External => "external".into(),
                Scope::Internal => "internal".into(),
            },
            rev_nat_id: value.rev_nat_id,
            backends: dumped,
        });
    }
    let counters = kernel::read_counters(bpffs)?
        .into_iter()
        .zip(proxy_abi::stat::NAMES)
        .map(|(value, name)| (name.to_owned(), value))
        .collect();
    let rev_sock_entries = kernel::count_rev_sock_entries(bpffs)?;
    Ok(Dump { services, counters, rev_sock_entries })
}

pub fn print_text(dump: &Dump) {
    println!("{:<28} {:<8} {:>7}  BACKENDS", "FRONTEND", "SCOPE", "REV-NAT");
    for service in &dump.services {
        let frontend = format!("{}:{}/{}", service.ip, service.port, service.protocol);
        let backends = if service.backends.is_empty() {
            "(none: connections are refused)".to_owned()
        } else {
            service.backends.iter().map(|b| format!("{}:{}", b.ip, b.port)).collect::<Vec<_>>().join(", ")
        };
        println!("{frontend:<28} {:<8} {:>7}  {backends}", service.scope, service.rev_nat_id);
    }
    println!();
    println!("counters:");
    for (name, value) in &dump.counters {
        println!("  {name:<22} {value}");
    }
    println!("socket reverse-translation entries: {}", dump.rev_sock_entries);
}
