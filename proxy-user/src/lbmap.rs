//! The load-balancer maps as the reconciler sees them: an interface, plus an in-memory fake with
//! fault injection and a consistency check, so reconciling is tested without a kernel.
//!
//! The kernel implementation lives in `kernel::KernelMaps`.

#[cfg(test)]
use std::collections::BTreeMap;
use std::io;

#[cfg(test)]
use proxy_abi::map_name;
use proxy_abi::{Backend4, BackendId, RevNat4, RevNatId, ServiceKey4, ServiceValue4};

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

/// Read and write access to the service, backend and reverse-NAT maps.
///
/// Deleting a key that is not there succeeds: every step of the reconciler is idempotent.
pub trait LbMaps {
    fn services(&self) -> Result<Vec<(ServiceKey4, ServiceValue4)>, MapError>;
    fn backends(&self) -> Result<Vec<(BackendId, Backend4)>, MapError>;
    fn rev_nats(&self) -> Result<Vec<(RevNatId, RevNat4)>, MapError>;
    fn put_service(&mut self, key: &ServiceKey4, value: &ServiceValue4) -> Result<(), MapError>;
    fn delete_service(&mut self, key: &ServiceKey4) -> Result<(), MapError>;
    fn put_backend(&mut self, id: BackendId, value: &Backend4) -> Result<(), MapError>;
    fn delete_backend(&mut self, id: BackendId) -> Result<(), MapError>;
    fn put_rev_nat(&mut self, id: RevNatId, value: &RevNat4) -> Result<(), MapError>;
    fn delete_rev_nat(&mut self, id: RevNatId) -> Result<(), MapError>;
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
    pub services: BTreeMap<ServiceKey4, ServiceValue4>,
    pub backends: BTreeMap<BackendId, Backend4>,
    pub rev_nats: BTreeMap<RevNatId, RevNat4>,
    pub maglev: BTreeMap<RevNatId, Vec<BackendId>>,
    pub capacity: usize,
    /// Number of further writes that succeed before every write fails (None: never fail).
    pub writes_until_failure: Option<usize>,
    /// Writes done so far.
    pub writes: usize,
    /// Inconsistencies a packet could have observed, recorded after each write.
    pub violations: Vec<String>,
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
        if let Err(problem) = self.check_consistent() {
            self.violations.push(problem);
        }
    }

    /// What the kernel programs rely on: every frontend's slots 1..=count exist, name existing
    /// backends, and its reverse-NAT entry exists; a frontend marked for Maglev has a full table
    /// that names existing backends.
    pub fn check_consistent(&self) -> Result<(), String> {
        for (key, value) in self.services.iter().filter(|(k, _)| k.backend_slot == 0) {
            for slot in 1..=value.count {
                let slot_key = ServiceKey4 { backend_slot: slot, ..*key };
                let Some(slot_value) = self.services.get(&slot_key) else {
                    return Err(format!("{key:?}: slot {slot} missing"));
                };
                if !self.backends.contains_key(&slot_value.backend_id) {
                    return Err(format!("{key:?}: slot {slot} names missing backend {}", slot_value.backend_id));
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
    fn services(&self) -> Result<Vec<(ServiceKey4, ServiceValue4)>, MapError> {
        Ok(self.services.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn backends(&self) -> Result<Vec<(BackendId, Backend4)>, MapError> {
        Ok(self.backends.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn rev_nats(&self) -> Result<Vec<(RevNatId, RevNat4)>, MapError> {
        Ok(self.rev_nats.iter().map(|(k, v)| (*k, *v)).collect())
    }
    fn put_service(&mut self, key: &ServiceKey4, value: &ServiceValue4) -> Result<(), MapError> {
        self.before_write()?;
        Self::put(&mut self.services, map_name::SERVICES4, self.capacity, *key, *value)?;
        self.after_write();
        Ok(())
    }
    fn delete_service(&mut self, key: &ServiceKey4) -> Result<(), MapError> {
        self.before_write()?;
        self.services.remove(key);
        self.after_write();
        Ok(())
    }
    fn put_backend(&mut self, id: BackendId, value: &Backend4) -> Result<(), MapError> {
        self.before_write()?;
        Self::put(&mut self.backends, map_name::BACKENDS4, self.capacity, id, *value)?;
        self.after_write();
        Ok(())
    }
    fn delete_backend(&mut self, id: BackendId) -> Result<(), MapError> {
        self.before_write()?;
        self.backends.remove(&id);
        self.after_write();
        Ok(())
    }
    fn put_rev_nat(&mut self, id: RevNatId, value: &RevNat4) -> Result<(), MapError> {
        self.before_write()?;
        Self::put(&mut self.rev_nats, map_name::REV_NAT4, self.capacity, id, *value)?;
        self.after_write();
        Ok(())
    }
    fn delete_rev_nat(&mut self, id: RevNatId) -> Result<(), MapError> {
        self.before_write()?;
        self.rev_nats.remove(&id);
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
