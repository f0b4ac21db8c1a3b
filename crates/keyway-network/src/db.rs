//! The link-state database: the latest advertisement of every known site, bounded.
//!
//! Every linked peer may flood advertisements of origins we have never heard of, each up to a
//! control message's size. Without a bound, one misbehaving peer could make every site of the
//! network hold an unbounded number of them, and recompute routes over all of them per message.

use std::collections::HashMap;

use crate::protocol::Advertisement;

/// Most sites a network may have, as seen from any one site. Skupper networks run to tens or
/// hundreds of sites; a route computation over this many stays well under a millisecond.
pub const MAX_SITES: usize = 4096;
/// Most bytes of names (keys, listened keys, links) all advertisements together may hold.
pub const MAX_BYTES: usize = 64 << 20;

/// Why an advertisement was not taken.
#[derive(Debug, PartialEq, Eq)]
pub enum Full {
    Sites,
    Bytes,
}

pub struct Db {
    by_origin: HashMap<String, Advertisement>,
    /// The sum of [`footprint`] over `by_origin`.
    bytes: usize,
    max_sites: usize,
    max_bytes: usize,
}

/// An advertisement's share of [`MAX_BYTES`]: its names plus a fixed overhead per name, so many
/// short names count too.
fn footprint(adv: &Advertisement) -> usize {
    const PER_NAME: usize = 32;
    let names = adv.keys.iter().chain(&adv.listening);
    PER_NAME * 2
        + adv.origin.len()
        + adv.id.len()
        + names.map(|n| n.len() + PER_NAME).sum::<usize>()
        + adv
            .links
            .iter()
            .map(|l| l.site.len() + PER_NAME)
            .sum::<usize>()
}

impl Default for Db {
    fn default() -> Self {
        Db::with_limits(MAX_SITES, MAX_BYTES)
    }
}

impl Db {
    pub fn with_limits(max_sites: usize, max_bytes: usize) -> Self {
        Db {
            by_origin: HashMap::new(),
            bytes: 0,
            max_sites,
            max_bytes,
        }
    }

    pub fn map(&self) -> &HashMap<String, Advertisement> {
        &self.by_origin
    }

    pub fn get(&self, origin: &str) -> Option<&Advertisement> {
        self.by_origin.get(origin)
    }

    pub fn values(&self) -> impl Iterator<Item = &Advertisement> {
        self.by_origin.values()
    }

    pub fn origins(&self) -> impl Iterator<Item = &String> {
        self.by_origin.keys()
    }

    /// Takes `adv` as its origin's latest, replacing the one before, unless that would pass a
    /// bound; then the one before (if any) stays. This site's own advertisement always fits
    /// (`own`): it is not a peer's to refuse.
    pub fn insert(&mut self, adv: Advertisement, own: bool) -> Result<(), Full> {
        let old = self.by_origin.get(&adv.origin).map_or(0, footprint);
        let bytes = self.bytes - old + footprint(&adv);
        if !own {
            if old == 0 && self.by_origin.len() >= self.max_sites {
                return Err(Full::Sites);
            }
            if bytes > self.max_bytes {
                return Err(Full::Bytes);
            }
        }
        self.bytes = bytes;
        self.by_origin.insert(adv.origin.clone(), adv);
        Ok(())
    }

    pub fn remove(&mut self, origin: &str) {
        if let Some(old) = self.by_origin.remove(origin) {
            self.bytes -= footprint(&old);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Adjacency;

    fn adv(origin: &str, keys: usize) -> Advertisement {
        Advertisement {
            origin: origin.into(),
            id: "id".into(),
            seq: 1,
            keys: (0..keys).map(|i| format!("key-{i}")).collect(),
            listening: vec!["l".into()],
            links: vec![Adjacency {
                site: "x".into(),
                cost: 1,
            }],
            draining: false,
        }
    }

    #[test]
    fn peers_fill_it_up_to_its_bounds_and_no_further() {
        let mut db = Db::with_limits(3, usize::MAX);
        for s in ["a", "b", "c"] {
            assert_eq!(db.insert(adv(s, 1), false), Ok(()));
        }
        assert_eq!(db.insert(adv("d", 1), false), Err(Full::Sites));
        // Known sites still update, and our own always fits.
        assert_eq!(db.insert(adv("a", 5), false), Ok(()));
        assert_eq!(db.get("a").map(|a| a.keys.len()), Some(5));
        assert_eq!(db.insert(adv("me", 1), true), Ok(()));
        // Our own counts: room comes only once two others are gone.
        db.remove("b");
        assert_eq!(db.insert(adv("d", 1), false), Err(Full::Sites));
        db.remove("c");
        assert_eq!(db.insert(adv("d", 1), false), Ok(()));

        let one = footprint(&adv("a", 10));
        let mut db = Db::with_limits(100, one * 2);
        assert_eq!(db.insert(adv("a", 10), false), Ok(()));
        assert_eq!(db.insert(adv("b", 10), false), Ok(()));
        assert_eq!(db.insert(adv("c", 0), false), Err(Full::Bytes));
        // Growing past the bound keeps the advertisement before; shrinking makes room.
        assert_eq!(db.insert(adv("a", 11), false), Err(Full::Bytes));
        assert_eq!(db.get("a").map(|a| a.keys.len()), Some(10));
        assert_eq!(db.insert(adv("a", 0), false), Ok(()));
        assert_eq!(db.insert(adv("c", 0), false), Ok(()));
        // The running total matches the contents after replacements and removals.
        db.remove("b");
        db.remove("nobody");
        assert_eq!(db.bytes, db.values().map(footprint).sum::<usize>());
    }
}
