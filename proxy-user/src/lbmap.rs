//! The load-balancer maps as the reconciler sees them: an interface, plus an in-memory fake with
//! fault injection and a consistency check, so reconciling is tested without a kernel.
//!
//! The kernel implementation lives in `kernel::KernelMaps`.

#[cfg(test)]
use std::collections::BTreeMap;
use std::io;

#[cfg(test)]
use proxy_abi::map_name;
use proxy_abi::{Backend4, Backend6, BackendId, RevNat4, RevNat6, RevNatId, ServiceKey4, ServiceKey6, ServiceValue4};

/// A key of the service map of either family (`epx_svc4_v1`, `epx_svc6_v1`); both maps hold
/// the same value type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SvcKey {
    V4(ServiceKey4),
    V6(ServiceKey6),
}

impl SvcKey {
    pub fn slot(&self) -> u16 {
        match self {
            Self::V4(k) => k.backend_slot,
            Self::V6(k) => k.backend_slot,
        }
    }

    /// The same frontend's key for `slot`.
    pub fn with_slot(&self, slot: u16) -> Self {
        match *self {
            Self::V4(k) => Self::V4(ServiceKey4 { backend_slot: slot, ..k }),
            Self::V6(k) => Self::V6(ServiceKey6 { backend_slot: slot, ..k }),
        }
    }
}

/// A value of the backend map of either family; ids come from one space for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackendValue {
    V4(Backend4),
    V6(Backend6),
}

impl BackendValue {
    pub fn is_ipv6(&self) -> bool {
        matches!(self, Self::V6(_))
    }
}

/// A value of the reverse-NAT map of either family; ids come from one space for both.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RevNatValue {
    V4(RevNat4),
    V6(RevNat6),
}

impl RevNatValue {
    pub fn is_ipv6(&self) -> bool {
        matches!(self, Self::V6(_))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("map {map} is full")]
    Full { map: &'static str },
    #[error("{op} on map {map} failed")]
    Syscall {
        map: &'static str,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

impl MapError {
    /// Classifies a failed map syscall: E2BIG/ENOSPC from an update mean the map is full.
    pub fn from_io(map: &'static str, op: &'static str, source: io::Error) -> Self {
        match source.raw_os_error() {
            Some(libc::E2BIG) | Some(libc::ENOSPC) => Self::Full { map },
            _ => Self::Syscall { map, op, source },
        }
    }
}

/// Read and write access to the service, backend and reverse-NAT maps of both families.
///
/// Deleting a key that is not there succeeds: every step of the reconciler is idempotent.
pub trait LbMaps {
    fn services(&self) -> Result<Vec<(SvcKey, ServiceValue4)>, MapError>;
    fn backends(&self) -> Result<Vec<(BackendId, BackendValue)>, MapError>;
    fn rev_nats(&self) -> Result<Vec<(RevNatId, RevNatValue)>, MapError>;
    fn put_service(&mut self, key: &SvcKey, value: &ServiceValue4) -> Result<(), MapError>;
    fn delete_service(&mut self, key: &SvcKey) -> Result<(), MapError>;
    fn put_backend(&mut self, id: BackendId, value: &BackendValue) -> Result<(), MapError>;
    /// Deletes backend `id` from the map of its family (`ipv6`).
    fn delete_backend(&mut self, id: BackendId, ipv6: bool) -> Result<(), MapError>;
    fn put_rev_nat(&mut self, id: RevNatId, value: &RevNatValue) -> Result<(), MapError>;
    fn delete_rev_nat(&mut self, id: RevNatId, ipv6: bool) -> Result<(), MapError>;
    /// Maglev tables by the reverse-NAT id of their external frontend (slot -> backend id).
    fn maglev_tables(&self) -> Result<Vec<(RevNatId, Vec<BackendId>)>, MapError>;
    /// `table` has exactly `proxy_abi::maglev::TABLE_SIZE` slots.
    fn put_maglev(&mut self, id: RevNatId, table: &[BackendId]) -> Result<(), MapError>;
    fn delete_maglev(&mut self, id: RevNatId) -> Result<(), MapError>;
}

#[cfg(test)]
/// In-memory maps with the kernel's capacity behaviour, an optional injected failure, and a
/// check run after every write that what a packet could observe is consistent.
#[derive(Clone, Debug)]
pub struct FakeMaps {
    pub services: BTreeMap<SvcKey, ServiceValue4>,
    pub backends: BTreeMap<BackendId, BackendValue>,
    pub rev_nats: BTreeMap<RevNatId, RevNatValue>,
    pub maglev: BTreeMap<RevNatId, Vec<BackendId>>,
    pub capacity: usize,
    /// Number of further writes that succeed before every write fails (None: never fail).
    pub writes_until_failure: Option<usize>,
    /// Writes done so far.
    pub writes: usize,
    /// Inconsistencies a packet could have observed, recorded after each write.
    pub violations: Vec<String>,
    /// Whether that check runs (it walks every entry: off for measurements at scale).
    pub checked: bool,
}

#[cfg(test)]
impl Default for FakeMaps {
    fn default() -> Self {
        Self::with_capacity(usize::MAX)
    }
}

#[cfg(test)]
impl FakeMaps {
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            services: BTreeMap::new(),
            backends: BTreeMap::new(),
            rev_nats: BTreeMap::new(),
            maglev: BTreeMap::new(),
            capacity,
            writes_until_failure: None,
            writes: 0,
            violations: Vec::new(),
            checked: true,
        }
    }

    fn before_write(&mut self) -> Result<(), MapError> {
        if let Some(left) = self.writes_until_failure.as_mut() {
            if *left == 0 {
                return Err(MapError::Syscall {
                    map: "fake",
                    op: "injected failure",
                    source: io::Error::from_raw_os_error(libc::EIO),
                });
            }
            *left -= 1;
        }
        self.writes += 1;
        Ok(())
    }

    fn after_write(&mut self) {
        if !self.checked {
            return;
        }
        if let Err(problem) = self.check_consistent() {
            self.violations.push(problem);
        }
    }

    /// What the kernel programs rely on: every frontend's slots 1..=count exist, name existing
    /// backends, and its reverse-NAT entry exists; a frontend marked for Maglev has a full table
    /// that names existing backends.
    pub fn check_consistent(&self) -> Result<(), String> {
        for (key, value) in self.services.iter().filter(|(k, _)| k.slot() == 0) {
            for slot in 1..=value.count {
                let slot_key = key.with_slot(slot);
                let Some(slot_value) = self.services.get(&slot_key) else {
                    return Err(format!("{key:?}: slot {slot} missing"));
                };
                match self.backends.get(&slot_value.backend_id) {
                    None => return Err(format!("{key:?}: slot {slot} names missing backend {}", slot_value.backend_id)),
                    Some(backend) if backend.is_ipv6() != matches!(key, SvcKey::V6(_)) => {
                        return Err(format!("{key:?}: slot {slot} names backend {} of the other family", slot_value.backend_id))
                    }
                    Some(_) => {}
                }
            }
            if !self.rev_nats.contains_key(&value.rev_nat_id) {
                return Err(format!("{key:?}: rev-NAT {} missing", value.rev_nat_id));
            }
            if value.flags & proxy_abi::svc_flags::MAGLEV != 0 {
                let Some(table) = self.maglev.get(&value.rev_nat_id) else {
                    return Err(format!("{key:?}: Maglev table {} missing", value.rev_nat_id));
                };
                if table.len() != proxy_abi::maglev::TABLE_SIZE as usize {
                    return Err(format!("{key:?}: Maglev table has {} slots", table.len()));
                }
                if let Some(id) = table.iter().find(|id| !self.backends.contains_key(id)) {
                    return Err(format!("{key:?}: Maglev table names missing backend {id}"));
                }
            }
        }
        Ok(())
    }

    fn put<K: Ord, V>(
        map: &mut BTreeMap<K, V>,
        name: &'static str,
        capacity: usize,
        key: K,
        value: V,
    ) -> Result<(), MapError> {
        if !map.contains_key(&key) && map.len() >= capacity {
            return Err(MapError::Full { map: name });
        }
        map.insert(key, value);
        Ok(())
    }
}

#[cfg(test)]
impl LbMaps for FakeMaps {
    fn services(&self) -> Result<Vec<(SvcKey, ServiceValue4)>, MapError> {
        Ok(self.services.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn backends(&self) -> Result<Vec<(BackendId, BackendValue)>, MapError> {
        Ok(self.backends.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn rev_nats(&self) -> Result<Vec<(RevNatId, RevNatValue)>, MapError> {
        Ok(self.rev_nats.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn put_service(&mut self, key: &SvcKey, value: &ServiceValue4) -> Result<(), MapError> {
        self.before_write()?;
        Self::put(&mut self.services, map_name::SERVICES4, self.capacity, *key, *value)?;
        self.after_write();
        Ok(())
    }
    fn delete_service(&mut self, key: &SvcKey) -> Result<(), MapError> {
        self.before_write()?;
        self.services.remove(key);
        self.after_write();
        Ok(())
    }
    fn put_backend(&mut self, id: BackendId, value: &BackendValue) -> Result<(), MapError> {
        self.before_write()?;
        Self::put(&mut self.backends, map_name::BACKENDS4, self.capacity, id, *value)?;
        self.after_write();
        Ok(())
    }
    fn delete_backend(&mut self, id: BackendId, ipv6: bool) -> Result<(), MapError> {
        self.before_write()?;
        if self.backends.get(&id).is_some_and(|b| b.is_ipv6() == ipv6) {
            self.backends.remove(&id);
        }
        self.after_write();
        Ok(())
    }
    fn put_rev_nat(&mut self, id: RevNatId, value: &RevNatValue) -> Result<(), MapError> {
        self.before_write()?;
        Self::put(&mut self.rev_nats, map_name::REV_NAT4, self.capacity, id, *value)?;
        self.after_write();
        Ok(())
    }
    fn delete_rev_nat(&mut self, id: RevNatId, ipv6: bool) -> Result<(), MapError> {
        self.before_write()?;
        if self.rev_nats.get(&id).is_some_and(|r| r.is_ipv6() == ipv6) {
            self.rev_nats.remove(&id);
        }
        self.after_write();
        Ok(())
    }
    fn maglev_tables(&self) -> Result<Vec<(RevNatId, Vec<BackendId>)>, MapError> {
        Ok(self.maglev.iter().map(|(k, v)| (*k, v.clone())).collect())
    }
    fn put_maglev(&mut self, id: RevNatId, table: &[BackendId]) -> Result<(), MapError> {
        self.before_write()?;
        Self::put(&mut self.maglev, map_name::MAGLEV4, self.capacity, id, table.to_vec())?;
        self.after_write();
        Ok(())
    }
    fn delete_maglev(&mut self, id: RevNatId) -> Result<(), MapError> {
        self.before_write()?;
        self.maglev.remove(&id);
        self.after_write();
        Ok(())
    }
}
