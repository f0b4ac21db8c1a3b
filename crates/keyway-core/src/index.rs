//! The one index every source feeds (`apply`/`delete`), as the linkerd policy-controller does:
//! the config directory today, a Kubernetes watch later. The resolver reads only this.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::load::{LoadedObject, Origin};
use crate::resource::{Kind, ObjectKey, Resource};

/// All objects in force, keyed by kind/namespace/name. Cloning is cheap (shared entries), so a
/// reload can build the next index beside the one serving.
#[derive(Clone, Debug, Default)]
pub struct Index {
    objects: BTreeMap<ObjectKey, Arc<LoadedObject>>,
    /// Objects with no version in force whose document was rejected, with where: a reference
    /// to one says it is not valid rather than not found.
    rejected: BTreeMap<ObjectKey, Origin>,
    /// Objects in force whose latest document was rejected (see [`Index::rejected_edit`]).
    rejected_edits: BTreeMap<ObjectKey, Origin>,
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

    /// Records the objects whose document was rejected: those with no version in force, and
    /// those whose last valid version stays in force (`edits`).
    pub fn set_rejected(
        &mut self,
        rejected: BTreeMap<ObjectKey, Origin>,
        edits: BTreeMap<ObjectKey, Origin>,
    ) {
        self.rejected = rejected;
        self.rejected_edits = edits;
    }

    /// Where the rejected latest edit of an object in force is, if its last valid version
    /// stands in for it.
    pub fn rejected_edit(&self, key: &ObjectKey) -> Option<&Origin> {
        self.rejected_edits.get(key)
    }

    /// Where the rejected document of an object not in force is, if it has one.
    pub fn rejected(&self, key: &ObjectKey) -> Option<&Origin> {
        self.rejected.get(key)
    }

    /// The rejected objects of one kind not in force, in key order, with where.
    pub fn rejected_of_kind(&self, kind: Kind) -> impl Iterator<Item = (&ObjectKey, &Origin)> {
        self.rejected.iter().filter(move |(k, _)| k.kind == kind)
    }

    /// What a reference to `kind namespace/name`, which is not in force, says: that its
    /// document was rejected (and where), or that there is none.
    pub fn absence(&self, kind: Kind, namespace: &str, name: &str) -> String {
        let key = ObjectKey::new(kind, namespace, name);
        match self.rejected.get(&key) {
            Some(at) => format!("{kind} {namespace}/{name} is not valid (see the error at {at})"),
            None => format!("{kind} {namespace}/{name} not found"),
        }
    }

    /// The typed resource under a key.
    pub fn resource(&self, kind: Kind, namespace: &str, name: &str) -> Option<&Resource> {
        self.objects
            .get(&ObjectKey::new(kind, namespace, name))
            .map(|o| &o.resource)
    }
}
