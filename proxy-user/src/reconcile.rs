//! Turns a desired state into map writes, applying only the difference.
//!
//! Owns the bookkeeping of what the maps hold (updated only after a write succeeded) and the id
//! allocation for backends and reverse-NAT entries. Write order per frontend, as Cilium's
//! reconciler: backends, slots 1..N, reverse NAT, slot 0 last, then trim surplus slots; so the
//! kernel never sees a half-built service. Frontend removals go first (they free capacity),
//! unreferenced backends and reverse-NAT entries are deleted last. Nothing is ever flushed.
//! Every value is compared whole, so a change of flags alone (traffic policy, affinity, a
//! backend moving to this node) is one in-place update of the entry concerned.
//!
//! With `--lb-algorithm maglev`, every external frontend with backends also gets a Maglev table
//! (built in `maglev`, keyed by its reverse-NAT id), written before the slots it replaces and
//! marked in slot 0; tables nobody marks any more are deleted with the garbage.
//!
//! IPv4 and IPv6 frontends go to their family's maps; backend ids and reverse-NAT ids come
//! from one space for both, so a family never needs to be guessed from an id.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use proxy_abi::{
    backend_flags, svc_flags, Backend4, Backend6, BackendId, RevNat4, RevNat6, RevNatId, ServiceKey4, ServiceKey6,
    ServiceValue4,
};

use crate::desired::{BackendAddr, DesiredState, Frontend, FrontendKind, FrontendSpec, Proto, Scope};
use crate::lbmap::{BackendValue, LbMaps, MapError, RevNatValue, SvcKey};
use crate::maglev;

/// How the packet path picks a new flow's backend (`--lb-algorithm`). The socket hooks always
/// pick at random: a local socket's flow never reaches another node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LbAlgorithm {
    /// A random slot per new flow (kube-proxy's behaviour).
    #[default]
    Random,
    /// Maglev consistent hashing of the client's address and port: every node with the same
    /// backend set sends a flow to the same backend, and a backend change moves few flows.
    Maglev,
}

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
    #[error("backend {backend} is not of its frontend's address family")]
    FamilyMismatch { backend: BackendAddr },
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
    /// Backend entries deleted because no frontend uses them any more.
    pub removed_backends: Vec<BackendAddr>,
}

/// Reference counts of map entries, and the entries that exist with none (the garbage).
#[derive(Debug)]
struct Refs<K> {
    counts: BTreeMap<K, u32>,
    unreferenced: BTreeSet<K>,
}

impl<K> Default for Refs<K> {
    fn default() -> Self {
        Self { counts: BTreeMap::new(), unreferenced: BTreeSet::new() }
    }
}

impl<K: Ord + Copy> Refs<K> {
    fn add(&mut self, key: K) {
        *self.counts.entry(key).or_insert(0) += 1;
        self.unreferenced.remove(&key);
    }

    /// `exists`: the entry is in its map (only then is it garbage once unreferenced).
    fn drop_ref(&mut self, key: K, exists: bool) {
        if let Some(count) = self.counts.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                self.counts.remove(&key);
                if exists {
                    self.unreferenced.insert(key);
                }
            }
        }
    }

    /// A new entry in the map: garbage until something refers to it.
    fn created(&mut self, key: K) {
        if !self.counts.contains_key(&key) {
            self.unreferenced.insert(key);
        }
    }

    fn held(&self, key: &K) -> bool {
        self.counts.contains_key(key)
    }

    fn compact(&mut self) {
        compact(&mut self.counts);
        self.unreferenced = std::mem::take(&mut self.unreferenced).into_iter().collect();
    }
}

/// Rebuilds a map from its sorted contents. Filled one insert at a time (ids in rising order,
/// as a sync makes them), a B-tree keeps its nodes about half full; built from a sorted
/// sequence, they are full. At 30 000 Services x 10 endpoints that is 20 MiB of the record.
fn compact<K: Ord, V>(map: &mut BTreeMap<K, V>) {
    *map = std::mem::take(map).into_iter().collect();
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
    /// Backend map contents, both directions. An entry is keyed by its address and whether it is
    /// local: the same address listed by two Services, local in one and remote in the other
    /// (another namespace's EndpointSlice can claim any address with this node's `nodeName`),
    /// gets an entry for each, so one Service's objects never decide another's SNAT.
    backend_ids: BTreeMap<(BackendAddr, bool), BackendId>,
    backends_by_id: BTreeMap<BackendId, BackendValue>,
    rev_nats: BTreeMap<RevNatId, RevNatValue>,
    /// Service-map keys this build cannot decode (another layout or garbage): removed on the
    /// first reconcile, never before the first full sync.
    strays: Vec<SvcKey>,
    next_backend_id: BackendId,
    next_rev_nat_id: RevNatId,
    /// Who holds what, kept with every write so that a pass that touched a few frontends finds
    /// the garbage it made without scanning every frontend (at 30 000 Services a scan of the
    /// slots alone took tens of milliseconds per endpoint change): slots naming each backend,
    /// frontends holding each reverse-NAT id, slot 0s marking each Maglev table ...
    backend_refs: Refs<BackendId>,
    rev_nat_refs: Refs<RevNatId>,
    maglev_marks: Refs<RevNatId>,
    /// Frontends whose last pass failed: retried by the next one, whatever it was given.
    pending: BTreeSet<Frontend>,
    algorithm: LbAlgorithm,
    /// Maglev map contents: reverse-NAT id of an external frontend -> its table.
    maglev_tables: BTreeMap<RevNatId, Vec<BackendId>>,
    /// Tables as indices into a backend list, by that list: frontends of one Service (a
    /// NodePort on every node address, LB IPs) share one backend set, so one computation.
    maglev_memo: BTreeMap<Vec<BackendAddr>, Vec<u32>>,
    /// Entries in `frontends` and `backend_ids` when the record was last compacted.
    compacted_size: usize,
}

impl<M> Reconciler<M> {
    /// Drops the record one part at a time and says what each held (`live`: the heap's live
    /// bytes), for the memory measurement.
    #[cfg(test)]
    pub fn drop_measured(self, live: impl Fn() -> f64) -> Vec<(&'static str, f64)> {
        let Self { maps, frontends, backend_ids, backends_by_id, rev_nats, strays, backend_refs, rev_nat_refs, maglev_marks, pending, maglev_tables, maglev_memo, .. } = self;
        let mut parts = Vec::new();
        macro_rules! part {
            ($($name:ident),*) => {$(
                let before = live();
                drop($name);
                parts.push((stringify!($name), before - live()));
            )*};
        }
        part!(maps, frontends, backend_ids, backends_by_id, rev_nats, strays, backend_refs, rev_nat_refs, maglev_marks, pending, maglev_tables, maglev_memo);
        parts
    }
}

/// Distinct backend sets whose Maglev tables an incremental pass may keep memoised (times 4).
const MAGLEV_MEMO_SETS: usize = 1024;

/// An IPv6 address as the maps hold it: four words in network byte order.
pub fn ipv6_words(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    std::array::from_fn(|i| u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]]))
}

pub fn ipv6_from_words(words: [u32; 4]) -> Ipv6Addr {
    let mut octets = [0u8; 16];
    for (i, word) in words.iter().enumerate() {
        octets[4 * i..4 * i + 4].copy_from_slice(&word.to_ne_bytes());
    }
    Ipv6Addr::from(octets)
}

/// The service-map key of a frontend's slot, in its family's map.
pub fn service_key(frontend: &Frontend, slot: u16) -> SvcKey {
    let (port_be, proto, scope) = (frontend.port.to_be(), frontend.proto.number(), frontend.scope.number());
    match frontend.addr {
        IpAddr::V4(ip) => SvcKey::V4(ServiceKey4::new(u32::from(ip).to_be(), port_be, proto, scope, slot)),
        IpAddr::V6(ip) => SvcKey::V6(ServiceKey6::new(ipv6_words(ip), port_be, proto, scope, slot)),
    }
}

pub fn decode_frontend(key: &SvcKey) -> Option<Frontend> {
    let (addr, port_be, proto, scope) = match key {
        SvcKey::V4(k) => (IpAddr::V4(Ipv4Addr::from(u32::from_be(k.addr_be))), k.port_be, k.proto, k.scope),
        SvcKey::V6(k) => (IpAddr::V6(ipv6_from_words(k.addr)), k.port_be, k.proto, k.scope),
    };
    Some(Frontend {
        addr,
        port: u16::from_be(port_be),
        proto: Proto::from_number(proto)?,
        scope: Scope::from_number(scope)?,
    })
}

/// Slot 0 of a frontend: backend count, reverse-NAT id, flags, and the affinity timeout.
pub fn slot0_value(spec: &FrontendSpec, count: u16, rev_nat_id: RevNatId, maglev: bool) -> ServiceValue4 {
    let mut flags = match spec.kind {
        FrontendKind::ClusterIp => 0,
        FrontendKind::NodePort => svc_flags::NODE_PORT,
        FrontendKind::ExternalIp => svc_flags::EXTERNAL_IP,
        FrontendKind::LoadBalancer => svc_flags::LOAD_BALANCER,
    };
    if spec.local_only {
        flags |= svc_flags::LOCAL_ONLY;
    }
    if spec.affinity_timeout.is_some() {
        flags |= svc_flags::AFFINITY;
    }
    if maglev {
        flags |= svc_flags::MAGLEV;
    }
    ServiceValue4 {
        backend_id: spec.affinity_timeout.unwrap_or(0),
        count,
        rev_nat_id,
        flags,
        flags2: 0,
        pad: [0; 2],
    }
}

/// The backend-map value of a backend, in its family's map.
pub fn backend_value(backend: &BackendAddr, local: bool) -> BackendValue {
    let (port_be, proto) = (backend.port.to_be(), backend.proto.number());
    let flags = if local { backend_flags::LOCAL } else { 0 };
    match backend.addr {
        IpAddr::V4(ip) => BackendValue::V4(Backend4 { addr_be: u32::from(ip).to_be(), port_be, proto, flags }),
        IpAddr::V6(ip) => BackendValue::V6(Backend6 { addr: ipv6_words(ip), port_be, proto, flags }),
    }
}

pub fn decode_backend(value: &BackendValue) -> Option<BackendAddr> {
    let (addr, port_be, proto) = match value {
        BackendValue::V4(b) => (IpAddr::V4(Ipv4Addr::from(u32::from_be(b.addr_be))), b.port_be, b.proto),
        BackendValue::V6(b) => (IpAddr::V6(ipv6_from_words(b.addr)), b.port_be, b.proto),
    };
    Some(BackendAddr { addr, port: u16::from_be(port_be), proto: Proto::from_number(proto)? })
}

/// The backend map entry's flags.
pub fn backend_flags_of(value: &BackendValue) -> u8 {
    match value {
        BackendValue::V4(b) => b.flags,
        BackendValue::V6(b) => b.flags,
    }
}

fn rev_nat_value(frontend: &Frontend) -> RevNatValue {
    let port_be = frontend.port.to_be();
    match frontend.addr {
        IpAddr::V4(ip) => RevNatValue::V4(RevNat4 { addr_be: u32::from(ip).to_be(), port_be, pad: [0; 2] }),
        IpAddr::V6(ip) => RevNatValue::V6(RevNat6 { addr: ipv6_words(ip), port_be, pad: [0; 2] }),
    }
}

/// The same address, port and protocol in the other scope: both entries share one reverse-NAT
/// id, since a reply is translated back to the same frontend whichever way the request came.
fn sibling(frontend: &Frontend) -> Frontend {
    let scope = match frontend.scope {
        Scope::Internal => Scope::External,
        Scope::External => Scope::Internal,
    };
    Frontend { scope, ..*frontend }
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
            if key.slot() == 0 {
                applied.slot0 = Some(value);
                applied.rev_nat_id = value.rev_nat_id;
            } else {
                applied.slots.insert(key.slot(), value.backend_id);
            }
        }
        let backends_by_id: BTreeMap<_, _> = maps.backends()?.into_iter().collect();
        let mut backend_ids = BTreeMap::new();
        for (id, value) in &backends_by_id {
            if let Some(addr) = decode_backend(value) {
                let local = backend_flags_of(value) & backend_flags::LOCAL != 0;
                backend_ids.entry((addr, local)).or_insert(*id);
            }
        }
        let rev_nats: BTreeMap<_, _> = maps.rev_nats()?.into_iter().collect();
        let maglev_tables: BTreeMap<_, _> = maps.maglev_tables()?.into_iter().collect();
        let next_backend_id = backends_by_id.keys().next_back().map_or(1, |id| id.wrapping_add(1).max(1));
        let max_rev_nat = frontends.values().map(|f| f.rev_nat_id).chain(rev_nats.keys().copied()).max();
        let next_rev_nat_id = max_rev_nat.map_or(1, |id| id.wrapping_add(1).max(1));
        let (mut backend_refs, mut rev_nat_refs, mut maglev_marks) = (Refs::default(), Refs::default(), Refs::default());
        for applied in frontends.values() {
            applied.slots.values().for_each(|id| backend_refs.add(*id));
            if applied.rev_nat_id != 0 {
                rev_nat_refs.add(applied.rev_nat_id);
            }
            if let Some(slot0) = applied.slot0.filter(|v| v.flags & svc_flags::MAGLEV != 0) {
                maglev_marks.add(slot0.rev_nat_id);
            }
        }
        backends_by_id.keys().for_each(|id| backend_refs.created(*id));
        rev_nats.keys().for_each(|id| rev_nat_refs.created(*id));
        maglev_tables.keys().for_each(|id| maglev_marks.created(*id));
        Ok(Self {
            maps,
            frontends,
            backend_ids,
            backends_by_id,
            rev_nats,
            strays,
            next_backend_id,
            next_rev_nat_id,
            backend_refs,
            rev_nat_refs,
            maglev_marks,
            pending: BTreeSet::new(),
            algorithm: LbAlgorithm::default(),
            maglev_tables,
            maglev_memo: BTreeMap::new(),
            compacted_size: 0,
        })
    }

    /// Sets how the packet path picks backends; applied by the next `reconcile`.
    pub fn with_algorithm(mut self, algorithm: LbAlgorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    #[cfg(test)]
    pub fn maps(&self) -> &M {
        &self.maps
    }

    #[cfg(test)]
    pub fn maps_mut(&mut self) -> &mut M {
        &mut self.maps
    }

    /// Frontends the kernel currently serves (slot 0 written).
    pub fn programmed_frontends(&self) -> usize {
        self.frontends.values().filter(|f| f.slot0.is_some()).count()
    }

    pub fn programmed_backends(&self) -> usize {
        self.backends_by_id.len()
    }

    /// Whether the maps hold an entry for this backend (local or not).
    pub fn has_backend(&self, backend: &BackendAddr) -> bool {
        [false, true].iter().any(|local| self.backend_ids.contains_key(&(*backend, *local)))
    }

    /// The reverse-NAT id of a frontend, if it has one.
    #[cfg(test)]
    pub fn rev_nat_id(&self, frontend: &Frontend) -> Option<RevNatId> {
        self.frontends.get(frontend).map(|f| f.rev_nat_id).filter(|id| *id != 0)
    }

    /// Brings the maps to `desired`, writing only what differs.
    pub fn reconcile(&mut self, desired: &DesiredState) -> ReconcileReport {
        let mut touched: BTreeSet<Frontend> = self.frontends.keys().copied().collect();
        touched.extend(desired.frontends.keys());
        let report = self.reconcile_changed(desired, &touched);
        // Forget tables of backend sets no frontend has any more (none are kept with `random`).
        if !self.maglev_memo.is_empty() {
            let sets: BTreeSet<Vec<BackendAddr>> =
                desired.frontends.values().map(|spec| spec.backends.iter().map(|b| b.addr).collect()).collect();
            self.maglev_memo.retain(|set, _| sets.contains(set));
        }
        report
    }

    /// Brings the entries of the `changed` frontends (and of those whose last pass failed) to
    /// `desired`: what an incremental sync hands over. Entries of other frontends are left
    /// alone; garbage is whatever these writes left unreferenced.
    pub fn reconcile_changed(&mut self, desired: &DesiredState, changed: &BTreeSet<Frontend>) -> ReconcileReport {
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
        let mut touched = std::mem::take(&mut self.pending);
        touched.extend(changed);

        // Removals first: they free capacity.
        for frontend in touched.iter().filter(|f| !desired.frontends.contains_key(f)) {
            if let Err(error) = self.remove_frontend(frontend, &mut report.writes) {
                report.failures.push(Failure { what: format!("removed frontend {frontend}"), error });
                self.pending.insert(*frontend);
            }
        }
        for frontend in &touched {
            let Some(spec) = desired.frontends.get(frontend) else { continue };
            if let Err(error) = self.upsert_frontend(frontend, spec, &mut report.writes) {
                report.failures.push(Failure { what: format!("Service {} ({frontend})", spec.service), error });
                self.pending.insert(*frontend);
            }
        }

        self.collect_garbage(&mut report);
        // Tables are memoised by backend set; a full pass prunes them, and churn alone must not
        // grow the memo without bound.
        if self.maglev_memo.len() > 4 * MAGLEV_MEMO_SETS {
            self.maglev_memo.clear();
        }
        // After a cold sync or any pass that grew the record by a quarter.
        let size = self.frontends.len() + self.backend_ids.len();
        if size > self.compacted_size + self.compacted_size / 4 + 1024 {
            self.compact();
            self.compacted_size = size;
        }
        report
    }

    /// Rebuilds the record's maps with full nodes ([`compact`]); what they hold is unchanged.
    fn compact(&mut self) {
        compact(&mut self.frontends);
        compact(&mut self.backend_ids);
        compact(&mut self.backends_by_id);
        compact(&mut self.rev_nats);
        self.backend_refs.compact();
        self.rev_nat_refs.compact();
    }

    /// The Maglev table of an external frontend, as backend ids (`ids[i]` is `backends[i]`'s).
    fn maglev_table(&mut self, backends: &[BackendAddr], ids: &[BackendId]) -> Vec<BackendId> {
        let indices = self.maglev_memo.entry(backends.to_vec()).or_insert_with(|| {
            let names: Vec<String> = backends.iter().map(ToString::to_string).collect();
            maglev::table(&names, proxy_abi::maglev::TABLE_SIZE)
        });
        indices.iter().map(|i| ids[*i as usize]).collect()
    }

    fn upsert_frontend(
        &mut self,
        frontend: &Frontend,
        spec: &FrontendSpec,
        writes: &mut usize,
    ) -> Result<(), ReconcileError> {
        let (key0, rev_nat) = (service_key(frontend, 0), rev_nat_value(frontend));
        let backends = &spec.backends;
        if let Some(other) = backends.iter().find(|b| b.addr.addr.is_ipv6() != frontend.addr.is_ipv6()) {
            return Err(ReconcileError::FamilyMismatch { backend: other.addr });
        }
        let count = u16::try_from(backends.len())
            .ok()
            .filter(|c| *c < u16::MAX)
            .ok_or(ReconcileError::TooManyBackends { count: backends.len() })?;
        let mut ids = Vec::with_capacity(backends.len());
        for backend in backends.iter() {
            ids.push(self.ensure_backend(&backend.addr, backend.local, writes)?);
        }

        let own = self.frontends.get(frontend).map(|f| f.rev_nat_id).filter(|id| *id != 0);
        let shared = self.frontends.get(&sibling(frontend)).map(|f| f.rev_nat_id).filter(|id| *id != 0);
        let rev_nat_id = match own.or(shared) {
            Some(id) => id,
            None => self.allocate_rev_nat_id()?,
        };
        // The table goes in before the slots and slot 0 that switch to it: new flows from outside
        // see either the old backend set or the new one, never a mix with missing entries.
        let use_maglev = self.algorithm == LbAlgorithm::Maglev && frontend.scope == Scope::External && count > 0;
        if use_maglev {
            let addrs: Vec<BackendAddr> = backends.iter().map(|b| b.addr).collect();
            let table = self.maglev_table(&addrs, &ids);
            if self.maglev_tables.get(&rev_nat_id) != Some(&table) {
                self.maps.put_maglev(rev_nat_id, &table)?;
                if self.maglev_tables.insert(rev_nat_id, table).is_none() {
                    self.maglev_marks.created(rev_nat_id);
                }
                *writes += 1;
            }
        }

        let applied = self.frontends.entry(*frontend).or_default();
        if applied.rev_nat_id != rev_nat_id {
            self.rev_nat_refs.add(rev_nat_id);
            if applied.rev_nat_id != 0 {
                let old = applied.rev_nat_id;
                self.rev_nat_refs.drop_ref(old, self.rev_nats.contains_key(&old));
            }
            applied.rev_nat_id = rev_nat_id;
        }

        for (slot, id) in (1..=count).zip(&ids) {
            if applied.slots.get(&slot) != Some(id) {
                let value = ServiceValue4 { backend_id: *id, ..Default::default() };
                self.maps.put_service(&key0.with_slot(slot), &value)?;
                self.backend_refs.add(*id);
                if let Some(old) = applied.slots.insert(slot, *id) {
                    self.backend_refs.drop_ref(old, self.backends_by_id.contains_key(&old));
                }
                *writes += 1;
            }
        }

        if self.rev_nats.get(&rev_nat_id) != Some(&rev_nat) {
            self.maps.put_rev_nat(rev_nat_id, &rev_nat)?;
            if self.rev_nats.insert(rev_nat_id, rev_nat).is_none() {
                self.rev_nat_refs.created(rev_nat_id);
            }
            *writes += 1;
        }

        let slot0 = slot0_value(spec, count, rev_nat_id, use_maglev);
        if applied.slot0 != Some(slot0) {
            self.maps.put_service(&key0, &slot0)?;
            let old = applied.slot0.replace(slot0);
            Self::mark_maglev(&mut self.maglev_marks, &self.maglev_tables, old, Some(slot0));
            *writes += 1;
        }

        let surplus: Vec<u16> = applied.slots.range(count + 1..).map(|(slot, _)| *slot).collect();
        for slot in surplus {
            self.maps.delete_service(&key0.with_slot(slot))?;
            if let Some(old) = applied.slots.remove(&slot) {
                self.backend_refs.drop_ref(old, self.backends_by_id.contains_key(&old));
            }
            *writes += 1;
        }
        Ok(())
    }

    /// Keeps the count of slot 0s that mark each Maglev table as one slot 0 changes.
    fn mark_maglev(
        marks: &mut Refs<RevNatId>,
        tables: &BTreeMap<RevNatId, Vec<BackendId>>,
        old: Option<ServiceValue4>,
        new: Option<ServiceValue4>,
    ) {
        let marking = |v: Option<ServiceValue4>| v.filter(|v| v.flags & svc_flags::MAGLEV != 0).map(|v| v.rev_nat_id);
        if let Some(id) = marking(new) {
            marks.add(id);
        }
        if let Some(id) = marking(old) {
            marks.drop_ref(id, tables.contains_key(&id));
        }
    }

    fn remove_frontend(&mut self, frontend: &Frontend, writes: &mut usize) -> Result<(), ReconcileError> {
        let Some(applied) = self.frontends.get_mut(frontend) else { return Ok(()) };
        let key0 = service_key(frontend, 0);
        // Slot 0 first: from this write on the frontend no longer exists for new connections.
        if applied.slot0.is_some() {
            self.maps.delete_service(&key0)?;
            let old = applied.slot0.take();
            Self::mark_maglev(&mut self.maglev_marks, &self.maglev_tables, old, None);
            *writes += 1;
        }
        let slots: Vec<u16> = applied.slots.keys().copied().collect();
        for slot in slots {
            self.maps.delete_service(&key0.with_slot(slot))?;
            if let Some(old) = applied.slots.remove(&slot) {
                self.backend_refs.drop_ref(old, self.backends_by_id.contains_key(&old));
            }
            *writes += 1;
        }
        if let Some(applied) = self.frontends.remove(frontend) {
            if applied.rev_nat_id != 0 {
                self.rev_nat_refs.drop_ref(applied.rev_nat_id, self.rev_nats.contains_key(&applied.rev_nat_id));
            }
        }
        Ok(())
    }

    /// Deletes backends no slot names and reverse-NAT entries no frontend owns, and Maglev
    /// tables no slot 0 marks (after every slot 0 is written: a table is in use only while a
    /// slot 0 says so).
    fn collect_garbage(&mut self, report: &mut ReconcileReport) {
        let unused: Vec<BackendId> = self.backend_refs.unreferenced.iter().copied().collect();
        for id in unused {
            let Some(value) = self.backends_by_id.get(&id).copied() else {
                self.backend_refs.unreferenced.remove(&id);
                continue;
            };
            match self.maps.delete_backend(id, value.is_ipv6()) {
                Ok(()) => {
                    report.writes += 1;
                    self.backend_refs.unreferenced.remove(&id);
                    self.backends_by_id.remove(&id);
                    if let Some(addr) = decode_backend(&value) {
                        let key = (addr, backend_flags_of(&value) & backend_flags::LOCAL != 0);
                        if self.backend_ids.get(&key) == Some(&id) {
                            self.backend_ids.remove(&key);
                        }
                        report.removed_backends.push(addr);
                    }
                }
                Err(error) => report.failures.push(Failure { what: format!("unused backend {id}"), error: error.into() }),
            }
        }

        let unmarked: Vec<RevNatId> = self.maglev_marks.unreferenced.iter().copied().collect();
        for id in unmarked {
            if !self.maglev_tables.contains_key(&id) {
                self.maglev_marks.unreferenced.remove(&id);
                continue;
            }
            match self.maps.delete_maglev(id) {
                Ok(()) => {
                    report.writes += 1;
                    self.maglev_marks.unreferenced.remove(&id);
                    self.maglev_tables.remove(&id);
                }
                Err(error) => report.failures.push(Failure { what: format!("unused Maglev table {id}"), error: error.into() }),
            }
        }

        let unowned: Vec<RevNatId> = self.rev_nat_refs.unreferenced.iter().copied().collect();
        for id in unowned {
            let Some(ipv6) = self.rev_nats.get(&id).map(RevNatValue::is_ipv6) else {
                self.rev_nat_refs.unreferenced.remove(&id);
                continue;
            };
            match self.maps.delete_rev_nat(id, ipv6) {
                Ok(()) => {
                    report.writes += 1;
                    self.rev_nat_refs.unreferenced.remove(&id);
                    self.rev_nats.remove(&id);
                }
                Err(error) => {
                    report.failures.push(Failure { what: format!("unused reverse-NAT {id}"), error: error.into() })
                }
            }
        }
    }

    /// The id of the backend entry for `backend` with this locality, writing the entry if it is
    /// new (or, after an adoption, differs).
    fn ensure_backend(&mut self, backend: &BackendAddr, local: bool, writes: &mut usize) -> Result<BackendId, ReconcileError> {
        let value = backend_value(backend, local);
        if let Some(id) = self.backend_ids.get(&(*backend, local)).copied() {
            if self.backends_by_id.get(&id) != Some(&value) {
                self.maps.put_backend(id, &value)?;
                if self.backends_by_id.insert(id, value).is_none() {
                    self.backend_refs.created(id);
                }
                *writes += 1;
            }
            return Ok(id);
        }
        let id = self.allocate_backend_id()?;
        self.maps.put_backend(id, &value)?;
        self.backend_ids.insert((*backend, local), id);
        self.backends_by_id.insert(id, value);
        self.backend_refs.created(id);
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

    /// An id is in use while a frontend holds it or its entry exists.
    fn allocate_rev_nat_id(&mut self) -> Result<RevNatId, ReconcileError> {
        let start = self.next_rev_nat_id;
        let mut id = start;
        loop {
            if id != 0 && !self.rev_nat_refs.held(&id) && !self.rev_nats.contains_key(&id) {
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
