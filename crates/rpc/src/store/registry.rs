//! The store's registry: its keys, versions and leases, and what each session holds, with the
//! rules that keep them consistent. A version is freed once it is not its key's value any more
//! and nobody holds it; a session's end lets go of everything it held. Synchronous and without
//! I/O: the server holds it under one lock and does the I/O the answers call for, and its tests
//! need no runtime.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::layout::EntryLayout;
use super::service::{Leased, Place};
use crate::WireError;
use crate::service::{SessionId, SessionTable};

#[derive(Default)]
pub(super) struct State {
    pub(super) next_version: u64,
    pub(super) next_lease: u64,
    pub(super) next_session: u64,
    /// Each key's current version.
    pub(super) keys: BTreeMap<String, u64>,
    pub(super) versions: HashMap<u64, Version>,
    pub(super) leases: SessionTable<Lease>,
    /// Allocations not sealed yet, by the session filling them (ids are version ids).
    pub(super) filling: SessionTable<()>,
    /// Bytes of every version that exists.
    pub(super) used: u64,
    /// Bytes of shared-memory objects that allocations are making now: promised to them, but
    /// not yet (or not all) taken from `/dev/shm`'s free space. An allocation's room is what is
    /// free less these, so two allocations that do not both fit are never both let through.
    pub(super) making_shm: u64,
    pub(super) stopping: bool,
}

pub(super) struct Version {
    /// The key it was sealed under (empty while unsealed).
    pub(super) key: String,
    pub(super) layout: Arc<EntryLayout>,
    pub(super) place: Place,
    /// The session filling it, until it is sealed.
    pub(super) filler: Option<u64>,
    /// Still its key's value.
    pub(super) current: bool,
    pub(super) refcount: u64,
    /// Whether a writable lease is out.
    pub(super) writer: bool,
    pub(super) ttl: Option<Duration>,
    /// Since when nobody holds it.
    pub(super) idle_since: Instant,
}

impl Version {
    pub(super) fn sealed(&self) -> bool {
        self.filler.is_none()
    }
}

pub(super) struct Lease {
    pub(super) version: u64,
    pub(super) writable: bool,
}

impl State {
    /// Takes version `id` out (its key too if it is current and `unkey`), returning its storage
    /// to delete. Only versions nobody holds are taken out.
    pub(super) fn drop_version(&mut self, id: u64, unkey: bool) -> Option<Place> {
        let v = self.versions.get(&id)?;
        if v.refcount > 0 {
            return None;
        }
        if unkey && v.current && self.keys.get(&v.key) == Some(&id) {
            self.keys.remove(&v.key);
        }
        let v = self.versions.remove(&id)?;
        self.filling.remove(id);
        self.used = self.used.saturating_sub(v.layout.bytes);
        Some(v.place)
    }

    /// Bytes of sealed current entries that nobody holds.
    pub(super) fn unreferenced(&self) -> u64 {
        self.versions.values().filter(|v| v.sealed() && v.current && v.refcount == 0).map(|v| v.layout.bytes).sum()
    }

    /// Lets go of lease `id`; returns the version's storage if that freed it.
    pub(super) fn release(&mut self, id: u64) -> Option<Place> {
        let (_, lease) = self.leases.remove(id)?;
        self.let_go(lease)
    }

    /// Undoes what `lease` (out of the table) counted; returns the version's storage if that
    /// freed it.
    pub(super) fn let_go(&mut self, lease: Lease) -> Option<Place> {
        let v = self.versions.get_mut(&lease.version)?;
        v.refcount = v.refcount.saturating_sub(1);
        if lease.writable {
            v.writer = false;
        }
        if v.refcount == 0 {
            v.idle_since = Instant::now();
            if !v.current {
                return self.drop_version(lease.version, false);
            }
        }
        None
    }

    /// Leases every key's current version to `session` (each lease counted in its version; a
    /// writable one marks it), or says which keys are missing. The layouts of versions in
    /// `known` are left out of the answer.
    pub(super) fn lease_keys(
        &mut self,
        session: SessionId,
        keys: &[String],
        writable: bool,
        known: &HashSet<u64>,
    ) -> Result<std::result::Result<Vec<Leased>, Vec<String>>, WireError> {
        let state = self;
        let mut found = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        for key in keys {
            match state.keys.get(key) {
                Some(&id) => found.push(id),
                None => missing.push(key.clone()),
            }
        }
        if !missing.is_empty() {
            return Ok(Err(missing));
        }
        if writable {
            let mut seen = HashSet::new();
            for (key, id) in keys.iter().zip(&found) {
                if state.versions.get(id).is_some_and(|v| v.writer) || !seen.insert(*id) {
                    return Err(WireError::Conflict { detail: format!("`{key}` is already loaded writable") });
                }
            }
        }
        let mut leased = Vec::with_capacity(found.len());
        for id in found {
            state.next_lease += 1;
            let lease = state.next_lease;
            // Lease ids are counted, never reused.
            let _ = state.leases.insert(session, lease, Lease { version: id, writable });
            let v = state.versions.get_mut(&id).expect("keys name existing versions");
            v.refcount += 1;
            v.writer |= writable;
            let layout = (!known.contains(&id)).then(|| Arc::clone(&v.layout));
            leased.push(Leased { lease, version: id, place: v.place.clone(), layout });
        }
        Ok(Ok(leased))
    }

    /// Ends `session`: lets go of its leases and of the allocations it was filling; returns
    /// the storage that freed.
    pub(super) fn end_session(&mut self, session: SessionId) -> Vec<Place> {
        let leases = self.leases.drain(session);
        let mut freed: Vec<Place> = leases.into_iter().filter_map(|(_, lease)| self.let_go(lease)).collect();
        let filled: Vec<u64> = self.filling.drain(session).into_iter().map(|(id, ())| id).collect();
        freed.extend(filled.into_iter().filter_map(|id| self.drop_version(id, false)));
        freed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Arc<EntryLayout> {
        let mut td = tensordict::TensorDict::new([2]);
        td.set("x", memmap_tensor::Tensor::from_slice(&[1.0f32, 2.0], [2]).unwrap()).unwrap();
        Arc::new(EntryLayout::contiguous_like(&td).unwrap())
    }

    /// A registry with `key` sealed as version `id`, current.
    fn with_entry(state: &mut State, key: &str, id: u64) {
        let layout = layout();
        state.used += layout.bytes;
        state.versions.insert(
            id,
            Version {
                key: key.to_owned(),
                layout,
                place: Place::Folder(format!("v{id}").into()),
                filler: None,
                current: true,
                refcount: 0,
                writer: false,
                ttl: None,
                idle_since: Instant::now(),
            },
        );
        if let Some(old) = state.keys.insert(key.to_owned(), id)
            && let Some(v) = state.versions.get_mut(&old)
        {
            v.current = false;
        }
    }

    #[test]
    fn a_replaced_version_is_freed_by_its_last_lease_and_not_before() {
        let mut state = State::default();
        with_entry(&mut state, "m", 1);
        let none = HashSet::new();
        let leased = state.lease_keys(7, &["m".to_owned()], false, &none).unwrap().unwrap();
        let other = state.lease_keys(8, &["m".to_owned()], false, &none).unwrap().unwrap();
        assert_eq!(state.versions[&1].refcount, 2);
        // Replaced: version 1 is not current, but two sessions hold it.
        with_entry(&mut state, "m", 2);
        assert_eq!(state.drop_version(1, false), None, "held versions stay");
        assert_eq!(state.release(leased[0].lease), None);
        assert!(state.release(leased[0].lease).is_none(), "a lease is released once");
        // The last holder's session ends: version 1 goes, version 2 stays.
        assert_eq!(state.end_session(8), vec![Place::Folder("v1".into())]);
        assert!(!state.versions.contains_key(&1) && state.versions.contains_key(&2));
        assert_eq!(state.used, state.versions[&2].layout.bytes);
        let _ = other;
    }

    #[test]
    fn missing_keys_are_named_and_a_writable_lease_is_alone() {
        let mut state = State::default();
        with_entry(&mut state, "a", 1);
        let none = HashSet::new();
        let keys = ["a".to_owned(), "b".to_owned(), "c".to_owned()];
        assert_eq!(state.lease_keys(1, &keys, false, &none).unwrap().unwrap_err(), ["b", "c"]);
        assert_eq!(state.leases.len(), 0, "nothing is leased when a key is missing");
        let writable = state.lease_keys(1, &["a".to_owned()], true, &none).unwrap().unwrap();
        let again = state.lease_keys(2, &["a".to_owned()], true, &none).unwrap_err();
        assert!(matches!(again, WireError::Conflict { .. }), "{again}");
        let twice = state.lease_keys(3, &["a".to_owned(), "a".to_owned()], true, &none);
        assert!(twice.is_err(), "one key twice, writable");
        // A read-only lease alongside is fine; the layout is left out when known.
        let known: HashSet<u64> = [1].into();
        let read = state.lease_keys(2, &["a".to_owned()], false, &known).unwrap().unwrap();
        assert!(read[0].layout.is_none() && writable[0].layout.is_some());
        assert!(state.end_session(1).is_empty(), "a current version stays when its holders go");
        assert!(!state.versions[&1].writer);
    }

    #[test]
    fn a_session_that_ends_mid_fill_frees_its_allocation() {
        let mut state = State::default();
        with_entry(&mut state, "a", 1);
        state.versions.get_mut(&1).unwrap().filler = Some(5);
        state.versions.get_mut(&1).unwrap().current = false;
        state.keys.clear();
        state.filling.insert(5, 1, ()).unwrap();
        assert_eq!(state.end_session(4), Vec::<Place>::new(), "another session's allocation stays");
        assert_eq!(state.end_session(5), vec![Place::Folder("v1".into())]);
        assert_eq!((state.used, state.filling.len()), (0, 0));
    }
}
