//! One Gateway's listener merge (SPEC §4), kept between resolves as a per-port table so that a
//! change to one resource re-settles only what that change can affect.
//!
//! Why this is exact: settlement never looks across ports, so a port settles alone exactly as it
//! does among all ports. On a port where every eligible listener speaks one protocol (all HTTP,
//! all HTTPS or all TLS), there are no protocol conflicts, and a listener only ever clashes with
//! listeners of the same hostname; each (port, hostname) group then settles alone too: in merge
//! order, the first resource with exactly one listener of that hostname holds it, a resource
//! with several loses them all without blocking anyone, and every later one is conflicted. Ports
//! with TCP or with several protocols (HTTPS beside TLS clash by protocol on one hostname) are
//! settled whole. A change to one resource thus re-settles the hostname
//! groups it has or had, or the whole port when the port is (or was) mixed. Fresh resolves use
//! [`listeners::settle`] over everything; the property tests compare the two.

use std::sync::Arc;

use super::fxhash::{FxMap as HashMap, FxSet as HashSet};
use super::listeners::{self, Conflict, ListenerIn, Standing};
use super::plan::Protocol;

/// One resource taking part in the merge.
struct Member {
    /// Position in merge order (Gateway 0, then ListenerSets by precedence).
    rank: usize,
    listeners: Arc<Vec<ListenerIn>>,
    standings: Vec<Standing>,
}

/// The eligible listeners on one port.
#[derive(Default)]
struct Port {
    /// How many speak HTTP, HTTPS, TLS and TCP (indexed by [`protocol_slot`]).
    protocols: [u32; 4],
    /// By hostname: (member, listener index), in no particular order.
    hosts: HashMap<String, Vec<(usize, usize)>>,
}

impl Port {
    /// Whether hostname groups settle independently (see the module docs).
    fn uniform(&self) -> bool {
        let [http, https, tls, tcp] = self.protocols;
        tcp == 0 && [http, https, tls].iter().filter(|n| **n > 0).count() <= 1
    }
}

fn protocol_slot(p: Protocol) -> usize {
    match p {
        Protocol::Http => 0,
        Protocol::Https => 1,
        Protocol::Tls => 2,
        Protocol::Tcp => 3,
    }
}

/// The persistent merge of one Gateway. Drop it when the Gateway or anything listener inputs
/// depend on changes; it only tracks changes of ListenerSets (added, removed, changed, moved).
/// Resources are named by the resolver's stable per-object slot, so finding them is indexing.
#[derive(Default)]
pub(crate) struct Merge {
    /// By slot; `None`: not a member.
    members: Vec<Option<Member>>,
    /// How many members there are.
    len: usize,
    ports: HashMap<i32, Port>,
}

/// Ports and hostnames whose settlement a change may affect, with whether each port was uniform
/// before the change.
#[derive(Default)]
struct Touched {
    ports: HashMap<i32, (bool, HashSet<String>)>,
}

impl Merge {
    /// Settles `resources` (Gateway first, then ListenerSets in precedence order), reusing the
    /// last settlement where nothing it depends on changed. Returns each resource's standings.
    /// `resources` are (slot, listeners); a slot names one object for as long as it exists.
    pub fn settle(&mut self, resources: &[(usize, &Arc<Vec<ListenerIn>>)]) -> Vec<Vec<Standing>> {
        if self.len == 0 {
            *self = Merge::default();
            return self.settle_fresh(resources);
        }
        let mut touched = Touched::default();
        let top = resources.iter().map(|(id, _)| id + 1).max().unwrap_or(0);
        if self.members.len() < top {
            self.members.resize_with(top, || None);
        }
        let mut live = vec![false; self.members.len()];
        for (rank, &(id, listeners)) in resources.iter().enumerate() {
            match self.members[id].as_mut() {
                Some(m) => {
                    m.rank = rank;
                    if !Arc::ptr_eq(&m.listeners, listeners) {
                        self.unlink(id, Some(&mut touched));
                        if let Some(m) = self.members[id].as_mut() {
                            m.listeners = Arc::clone(listeners);
                        }
                        self.link(id, Some(&mut touched));
                    }
                }
                None => {
                    self.insert(id, rank, listeners);
                    self.link(id, Some(&mut touched));
                }
            }
            live[id] = true;
        }
        for (id, live) in live.into_iter().enumerate() {
            if !live && self.members[id].is_some() {
                self.unlink(id, Some(&mut touched));
                self.members[id] = None;
                self.len -= 1;
            }
        }
        for (port, (was_uniform, hosts)) in touched.ports {
            let uniform = self.ports.get(&port).is_some_and(Port::uniform);
            if was_uniform && uniform {
                for host in &hosts {
                    self.settle_host(port, host);
                }
            } else {
                self.settle_port(port);
            }
            if self.ports.get(&port).is_some_and(|p| p.hosts.is_empty()) {
                self.ports.remove(&port);
            }
        }
        resources
            .iter()
            .map(|(id, _)| self.member(*id).standings.clone())
            .collect()
    }

    /// Settles everything with [`listeners::settle`] and builds the table from the result.
    fn settle_fresh(&mut self, resources: &[(usize, &Arc<Vec<ListenerIn>>)]) -> Vec<Vec<Standing>> {
        let lists: Vec<&[ListenerIn]> = resources.iter().map(|(_, l)| l.as_slice()).collect();
        let standings = listeners::settle(&lists);
        let top = resources.iter().map(|(id, _)| id + 1).max().unwrap_or(0);
        self.members.resize_with(top, || None);
        for (rank, (&(id, listeners), s)) in resources.iter().zip(&standings).enumerate() {
            self.insert(id, rank, listeners);
            self.link(id, None);
            if let Some(m) = self.members[id].as_mut() {
                m.standings = s.clone();
            }
        }
        standings
    }

    fn member(&self, id: usize) -> &Member {
        self.members[id].as_ref().expect("live member")
    }

    /// Makes slot `id` (within `members`) a member.
    fn insert(&mut self, id: usize, rank: usize, listeners: &Arc<Vec<ListenerIn>>) {
        if self.members[id].is_none() {
            self.len += 1;
        }
        self.members[id] = Some(Member {
            rank,
            listeners: Arc::clone(listeners),
            standings: Vec::new(),
        });
    }

    /// Notes that `port`/`host` must be re-settled, remembering whether the port was uniform
    /// before this change first touched it.
    fn touch(&self, touched: Option<&mut Touched>, port: i32, host: &str) {
        let Some(touched) = touched else { return };
        let entry = touched.ports.entry(port).or_insert_with(|| {
            let uniform = self.ports.get(&port).is_none_or(Port::uniform);
            (uniform, HashSet::default())
        });
        if !entry.1.contains(host) {
            entry.1.insert(host.to_string());
        }
    }

    /// Adds member `id`'s eligible listeners to the table; every listener starts `Invalid` and
    /// the eligible ones are settled by the caller (their groups are touched).
    fn link(&mut self, id: usize, mut touched: Option<&mut Touched>) {
        let listeners = Arc::clone(&self.member(id).listeners);
        for (j, l) in listeners.iter().enumerate() {
            let Some(p) = l.eligible() else { continue };
            self.touch(touched.as_deref_mut(), l.spec.port, l.hostname());
            let port = self.ports.entry(l.spec.port).or_default();
            port.protocols[protocol_slot(p)] += 1;
            port.hosts
                .entry(l.hostname().to_string())
                .or_default()
                .push((id, j));
        }
        if let Some(m) = self.members[id].as_mut() {
            m.standings = vec![Standing::Invalid; listeners.len()];
        }
    }

    /// Removes member `id`'s listeners from the table.
    fn unlink(&mut self, id: usize, mut touched: Option<&mut Touched>) {
        let listeners = Arc::clone(&self.member(id).listeners);
        for l in listeners.iter() {
            let Some(p) = l.eligible() else { continue };
            self.touch(touched.as_deref_mut(), l.spec.port, l.hostname());
            let Some(port) = self.ports.get_mut(&l.spec.port) else {
                continue;
            };
            port.protocols[protocol_slot(p)] -= 1;
            if let Some(group) = port.hosts.get_mut(l.hostname()) {
                group.retain(|(m, _)| *m != id);
                if group.is_empty() {
                    port.hosts.remove(l.hostname());
                }
            }
        }
    }

    /// Entries of `entries` in merge order.
    fn sorted(&self, mut entries: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
        entries.sort_by_key(|&(id, j)| (self.member(id).rank, j));
        entries
    }

    /// Re-settles one hostname group of a uniform port (see the module docs).
    fn settle_host(&mut self, port: i32, host: &str) {
        let Some(group) = self.ports.get(&port).and_then(|p| p.hosts.get(host)) else {
            return;
        };
        let entries = self.sorted(group.clone());
        let mut held = false;
        let mut i = 0;
        while i < entries.len() {
            let id = entries[i].0;
            let n = entries[i..].iter().take_while(|(m, _)| *m == id).count();
            let standing = if held || n > 1 {
                Standing::Conflicted(Conflict::Hostname)
            } else {
                held = true;
                Standing::Accepted
            };
            if let Some(m) = self.members[id].as_mut() {
                for &(_, j) in &entries[i..i + n] {
                    m.standings[j] = standing;
                }
            }
            i += n;
        }
    }

    /// Re-settles every listener on `port` with [`listeners::settle_refs`].
    fn settle_port(&mut self, port: i32) {
        let Some(p) = self.ports.get(&port) else {
            return;
        };
        let entries = self.sorted(p.hosts.values().flatten().copied().collect());
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (id, j) in entries {
            match groups.last_mut() {
                Some((last, js)) if *last == id => js.push(j),
                _ => groups.push((id, vec![j])),
            }
        }
        let lists: Vec<Vec<&ListenerIn>> = groups
            .iter()
            .map(|(id, js)| {
                let ls = &self.member(*id).listeners;
                js.iter().map(|&j| &ls[j]).collect()
            })
            .collect();
        let standings = listeners::settle_refs(&lists);
        drop(lists);
        for ((id, js), s) in groups.into_iter().zip(standings) {
            if let Some(m) = self.members[id].as_mut() {
                for (j, s) in js.into_iter().zip(s) {
                    m.standings[j] = s;
                }
            }
        }
    }
}
