//! The one index every source feeds (`apply`/`delete`), as the linkerd policy-controller does:
//! the config directory today, a Kubernetes watch later. The resolver reads only this.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::load::LoadedObject;
use crate::resource::{Kind, ObjectKey, Resource};

/// All objects in force, keyed by kind/namespace/name. Cloning is cheap (shared entries), so a
/// reload can build the next index beside the one serving.
#[derive(Clone, Debug, Default)]
pub struct Index {
    objects: BTreeMap<ObjectKey, Arc<LoadedObject>>,
}

impl Index {
    /// Inserts or replaces an object. Returns true when anything changed.
    pub fn apply(&mut self, object: LoadedObject) -> bool {
        let key = object.key.clone();
        match self.objects.get(&key) {
            Some(old) if old.resource == object.resource && old.origin == object.origin => false,
            _ => {
                self.objects.insert(key, Arc::new(object));
                true
            }
        }
    }

    /// Removes an object, returning it if it was present.
    pub fn delete(&mut self, key: &ObjectKey) -> Option<Arc<LoadedObject>> {
        self.objects.remove(key)
    }

    pub fn get(&self, key: &ObjectKey) -> Option<&Arc<LoadedObject>> {
        self.objects.get(key)
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    pub fn keys(&self) -> impl Iterator<Item = &ObjectKey> {
        self.objects.keys()
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<LoadedObject>> {
        self.objects.values()
    }

    /// Every object of one kind, in key order (namespace, then name).
    pub fn of_kind(&self, kind: Kind) -> impl Iterator<Item = &Arc<LoadedObject>> {
        self.objects.values().filter(move |o| o.key.kind == kind)
    }

    /// The typed resource under a key.
    pub fn resource(&self, kind: Kind, namespace: &str, name: &str) -> Option<&Resource> {
        self.objects
            .get(&ObjectKey::new(kind, namespace, name))
            .map(|o| &o.resource)
    }
}
