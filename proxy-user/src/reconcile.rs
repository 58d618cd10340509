//! Turns a desired state into map writes, applying only the difference.
//!
//! Owns the bookkeeping of what the maps hold (updated only after a write succeeded) and the id
//! allocation for backends and reverse-NAT entries. Write order per frontend, as Cilium's
//! reconciler: backends, slots 1..N, reverse NAT, slot 0 last, then trim surplus slots; so the
//! kernel never sees a half-built service. Frontend removals go first (they free capacity),
//! unreferenced backends and reverse-NAT entries are deleted last. Nothing is ever flushed.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use proxy_abi::{Backend4, BackendId, RevNat4, RevNatId, ServiceKey4, ServiceValue4};

use crate::desired::{BackendAddr, DesiredState, Frontend, Proto, Scope};
use crate::lbmap::{LbMaps, MapError};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("writing the datapath maps failed")]
    Map(#[from] MapError),
    #[error("no free backend id")]
    BackendIdsExhausted,
    #[error("no free reverse-NAT id (all 65535 in use)")]
    RevNatIdsExhausted,
    #[error("{count} backends exceed the limit of 65535 per frontend")]
    TooManyBackends { count: usize },
}

/// A frontend that could not be (fully) programmed in this pass; the maps still hold a
/// consistent earlier state for it, and the next pass retries.
#[derive(Debug)]
pub struct Failure {
    /// `Service ns/name:port (VIP:port/PROTO)` or the map entry concerned.
    pub what: String,
    pub error: ReconcileError,
}

#[derive(Debug, Default)]
pub struct ReconcileReport {
    pub writes: usize,
    pub failures: Vec<Failure>,
}

/// What the service map holds for one frontend.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct AppliedFrontend {
    /// Reserved for this frontend (0: none yet); kept across updates and restarts.
    rev_nat_id: RevNatId,
    slot0: Option<ServiceValue4>,
    slots: BTreeMap<u16, BackendId>,
}

pub struct Reconciler<M> {
    maps: M,
    frontends: BTreeMap<Frontend, AppliedFrontend>,
    /// Backend map contents, both directions.
    backend_ids: BTreeMap<BackendAddr, BackendId>,
    backends_by_id: BTreeMap<BackendId, Backend4>,
    rev_nats: BTreeMap<RevNatId, RevNat4>,
    /// Service-map keys this build cannot decode (another layout or garbage): removed on the
    /// first reconcile, never before the first full sync.
    strays: Vec<ServiceKey4>,
    next_backend_id: BackendId,
    next_rev_nat_id: RevNatId,
}

pub fn service_key(frontend: &Frontend, slot: u16) -> ServiceKey4 {
    ServiceKey4::new(
        u32::from(frontend.addr).to_be(),
        frontend.port.to_be(),
        frontend.proto.number(),
        frontend.scope.number(),
        slot,
    )
}

pub fn decode_frontend(key: &ServiceKey4) -> Option<Frontend> {
    Some(Frontend {
        addr: Ipv4Addr::from(u32::from_be(key.addr_be)),
        port: u16::from_be(key.port_be),
        proto: Proto::from_number(key.proto)?,
        scope: Scope::from_number(key.scope)?,
    })
}

pub fn backend_value(backend: &BackendAddr) -> Backend4 {
    Backend4 {
        addr_be: u32::from(backend.addr).to_be(),
        port_be: backend.port.to_be(),
        proto: backend.proto.number(),
        flags: 0,
    }
}

pub fn decode_backend(value: &Backend4) -> Option<BackendAddr> {
    Some(BackendAddr {
        addr: Ipv4Addr::from(u32::from_be(value.addr_be)),
        port: u16::from_be(value.port_be),
        proto: Proto::from_number(value.proto)?,
    })
}

fn rev_nat_value(frontend: &Frontend) -> RevNat4 {
    RevNat4 { addr_be: u32::from(frontend.addr).to_be(), port_be: frontend.port.to_be(), pad: [0; 2] }
}

impl<M: LbMaps> Reconciler<M> {
    /// Re-learns what the maps already hold, so that ids keep their meaning across restarts.
    /// Writes nothing.
    pub fn adopt(maps: M) -> Result<Self, MapError> {
        let mut frontends: BTreeMap<Frontend, AppliedFrontend> = BTreeMap::new();
        let mut strays = Vec::new();
        for (key, value) in maps.services()? {
            let Some(frontend) = decode_frontend(&key) else {
                strays.push(key);
                continue;
            };
            let applied = frontends.entry(frontend).or_default();
            if key.backend_slot == 0 {
                applied.slot0 = Some(value);
                applied.rev_nat_id = value.rev_nat_id;
            } else {
                applied.slots.insert(key.backend_slot, value.backend_id);
            }
        }
        let backends_by_id: BTreeMap<_, _> = maps.backends()?.into_iter().collect();
        let mut backend_ids = BTreeMap::new();
        for (id, value) in &backends_by_id {
            if let Some(addr) = decode_backend(value) {
                backend_ids.entry(addr).or_insert(*id);
            }
        }
        let rev_nats: BTreeMap<_, _> = maps.rev_nats()?.into_iter().collect();
        let next_backend_id = backends_by_id.keys().next_back().map_or(1, |id| id.wrapping_add(1).max(1));
        let max_rev_nat = frontends.values().map(|f| f.rev_nat_id).chain(rev_nats.keys().copied()).max();
        let next_rev_nat_id = max_rev_nat.map_or(1, |id| id.wrapping_add(1).max(1));
        Ok(Self {
            maps,
            frontends,
            backend_ids,
            backends_by_id,
            rev_nats,
            strays,
            next_backend_id,
            next_rev_nat_id,
        })
    }

    #[cfg(test)]
    pub fn maps(&self) -> &M {
        &self.maps
    }

    /// Frontends the kernel currently serves (slot 0 written).
    pub fn programmed_frontends(&self) -> usize {
        self.frontends.values().filter(|f| f.slot0.is_some()).count()
    }

    pub fn programmed_backends(&self) -> usize {
        self.backends_by_id.len()
    }

    /// The reverse-NAT id of a frontend, if it has one.
    #[cfg(test)]
    pub fn rev_nat_id(&self, frontend: &Frontend) -> Option<RevNatId> {
        self.frontends.get(frontend).map(|f| f.rev_nat_id).filter(|id| *id != 0)
    }

    /// Brings the maps to `desired`, writing only what differs.
    pub fn reconcile(&mut self, desired: &DesiredState) -> ReconcileReport {
        let mut report = ReconcileReport::default();

        for key in std::mem::take(&mut self.strays) {
            match self.maps.delete_service(&key) {
                Ok(()) => report.writes += 1,
                Err(error) => {
                    report.failures.push(Failure { what: format!("undecodable entry {key:?}"), error: error.into() });
                    self.strays.push(key);
                }
            }
        }

        let gone: Vec<Frontend> =
            self.frontends.keys().filter(|f| !desired.frontends.contains_key(f)).copied().collect();
        for frontend in gone {
            if let Err(error) = self.remove_frontend(&frontend, &mut report.writes) {
                report.failures.push(Failure { what: format!("removed frontend {frontend}"), error });
            }
        }

        for (frontend, spec) in &desired.frontends {
            if let Err(error) = self.upsert_frontend(frontend, &spec.backends, &mut report.writes) {
                report.failures.push(Failure { what: format!("Service {} ({frontend})", spec.service), error });
            }
        }

        self.collect_garbage(&mut report);
        report
    }

    fn upsert_frontend(
        &mut self,
        frontend: &Frontend,
        backends: &[BackendAddr],
        writes: &mut usize,
    ) -> Result<(), ReconcileError> {
        let count = u16::try_from(backends.len())
            .ok()
            .filter(|c| *c < u16::MAX)
            .ok_or(ReconcileError::TooManyBackends { count: backends.len() })?;
        let mut ids = Vec::with_capacity(backends.len());
        for backend in backends {
            ids.push(self.ensure_backend(backend, writes)?);
        }

        let rev_nat_id = match self.frontends.get(frontend).map(|f| f.rev_nat_id).filter(|id| *id != 0) {
            Some(id) => id,
            None => {
                let id = self.allocate_rev_nat_id()?;
                self.frontends.entry(*frontend).or_default().rev_nat_id = id;
                id
            }
        };
        let applied = self.frontends.entry(*frontend).or_default();

        for (slot, id) in (1..=count).zip(&ids) {
            if applied.slots.get(&slot) != Some(id) {
                let value = ServiceValue4 { backend_id: *id, ..Default::default() };
                self.maps.put_service(&service_key(frontend, slot), &value)?;
                applied.slots.insert(slot, *id);
                *writes += 1;
            }
        }

        let rev_nat = rev_nat_value(frontend);
        if self.rev_nats.get(&rev_nat_id) != Some(&rev_nat) {
            self.maps.put_rev_nat(rev_nat_id, &rev_nat)?;
            self.rev_nats.insert(rev_nat_id, rev_nat);
            *writes += 1;
        }

        let slot0 = ServiceValue4 { backend_id: 0, count, rev_nat_id, flags: 0, flags2: 0, pad: [0; 2] };
        if applied.slot0 != Some(slot0) {
            self.maps.put_service(&service_key(frontend, 0), &slot0)?;
            applied.slot0 = Some(slot0);
            *writes += 1;
        }

        let surplus: Vec<u16> = applied.slots.range(count + 1..).map(|(slot, _)| *slot).collect();
        for slot in surplus {
            self.maps.delete_service(&service_key(frontend, slot))?;
            applied.slots.remove(&slot);
            *writes += 1;
        }
        Ok(())
    }

    fn remove_frontend(&mut self, frontend: &Frontend, writes: &mut usize) -> Result<(), ReconcileError> {
        let Some(applied) = self.frontends.get_mut(frontend) else { return Ok(()) };
        // Slot 0 first: from this write on the frontend no longer exists for new connections.
        if applied.slot0.is_some() {
            self.maps.delete_service(&service_key(frontend, 0))?;
            applied.slot0 = None;
            *writes += 1;
        }
        let slots: Vec<u16> = applied.slots.keys().copied().collect();
        for slot in slots {
            self.maps.delete_service(&service_key(frontend, slot))?;
            applied.slots.remove(&slot);
            *writes += 1;
        }
        self.frontends.remove(frontend);
        Ok(())
    }

    /// Deletes backends no slot names and reverse-NAT entries no frontend owns.
    fn collect_garbage(&mut self, report: &mut ReconcileReport) {
        let referenced: BTreeSet<BackendId> =
            self.frontends.values().flat_map(|f| f.slots.values().copied()).collect();
        let unused: Vec<BackendId> =
            self.backends_by_id.keys().filter(|id| !referenced.contains(id)).copied().collect();
        for id in unused {
            match self.maps.delete_backend(id) {
                Ok(()) => {
                    report.writes += 1;
                    if let Some(addr) = self.backends_by_id.remove(&id).as_ref().and_then(decode_backend) {
                        if self.backend_ids.get(&addr) == Some(&id) {
                            self.backend_ids.remove(&addr);
                        }
                    }
                }
                Err(error) => report.failures.push(Failure { what: format!("unused backend {id}"), error: error.into() }),
            }
        }

        let owned: BTreeSet<RevNatId> = self.frontends.values().map(|f| f.rev_nat_id).collect();
        let unowned: Vec<RevNatId> = self.rev_nats.keys().filter(|id| !owned.contains(id)).copied().collect();
        for id in unowned {
            match self.maps.delete_rev_nat(id) {
                Ok(()) => {
                    report.writes += 1;
                    self.rev_nats.remove(&id);
                }
                Err(error) => {
                    report.failures.push(Failure { what: format!("unused reverse-NAT {id}"), error: error.into() })
                }
            }
        }
    }

    fn ensure_backend(&mut self, backend: &BackendAddr, writes: &mut usize) -> Result<BackendId, ReconcileError> {
        if let Some(id) = self.backend_ids.get(backend) {
            return Ok(*id);
        }
        let id = self.allocate_backend_id()?;
        let value = backend_value(backend);
        self.maps.put_backend(id, &value)?;
        self.backend_ids.insert(*backend, id);
        self.backends_by_id.insert(id, value);
        *writes += 1;
        Ok(id)
    }

    /// Ids advance monotonically (wrapping, skipping those in use), so a freed id is not handed
    /// out again soon: a flow that remembers an old id must not land on a new backend.
    fn allocate_backend_id(&mut self) -> Result<BackendId, ReconcileError> {
        let start = self.next_backend_id;
        let mut id = start;
        loop {
            if id != 0 && !self.backends_by_id.contains_key(&id) {
                self.next_backend_id = id.wrapping_add(1);
                return Ok(id);
            }
            id = id.wrapping_add(1);
            if id == start {
                return Err(ReconcileError::BackendIdsExhausted);
            }
        }
    }

    fn allocate_rev_nat_id(&mut self) -> Result<RevNatId, ReconcileError> {
        let in_use: BTreeSet<RevNatId> =
            self.frontends.values().map(|f| f.rev_nat_id).chain(self.rev_nats.keys().copied()).collect();
        let start = self.next_rev_nat_id;
        let mut id = start;
        loop {
            if id != 0 && !in_use.contains(&id) {
                self.next_rev_nat_id = id.wrapping_add(1);
                return Ok(id);
            }
            id = id.wrapping_add(1);
            if id == start {
                return Err(ReconcileError::RevNatIdsExhausted);
            }
        }
    }
}

#[cfg(test)]
mod tests;
