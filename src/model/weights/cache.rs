//! The weight store's least-recently-used cache, with two budgets: bytes held on the host and
//! bytes held on a device. A weight read from a checkpoint is held on the host and, once a GPU
//! op uses it, on the device too; a weight generated on the GPU is held on the device alone. The
//! bytes of an entry are measured again each time it is used, since a device copy (or a host
//! copy) may have been attached since it was cached.
//!
//! Each entry carries a use stamp and the order is a map from stamp to name, so finding and
//! refreshing an entry costs a logarithm of the entries, not a scan of them (a full-size model
//! caches thousands of expert matrices and asks for dozens per layer and step).

use crate::tensor::Tensor;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Bytes one cached tensor holds where.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    pub host: usize,
    pub device: usize,
}

impl Held {
    /// What `t` holds now: its host copy (f32) if made, and its device buffer if attached.
    pub fn of(t: &Tensor) -> Held {
        Held {
            host: if t.on_host() { t.size_bytes() } else { 0 },
            device: t.device().map_or(0, |d| d.bytes()),
        }
    }
}

/// The most bytes kept at once on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    pub host: usize,
    pub device: usize,
}

impl Budgets {
    /// Whether a tensor holding `held` may be cached at all.
    pub fn admits(&self, held: Held) -> bool {
        held.host <= self.host && held.device <= self.device
    }
}

struct Entry {
    tensor: Arc<Tensor>,
    held: Held,
    stamp: u64,
}

#[derive(Default)]
pub struct LruCache {
    entries: HashMap<String, Entry>,
    /// Names by last use, oldest first.
    order: BTreeMap<u64, String>,
    next_stamp: u64,
    held: Held,
}

impl LruCache {
    /// The cached tensor, marked as just used; entries past `budgets` (its bytes may have
    /// grown) are evicted, oldest first, never the one returned.
    pub fn touch(&mut self, name: &str, budgets: Budgets) -> Option<Arc<Tensor>> {
        let stamp = self.stamp();
        let entry = self.entries.get_mut(name)?;
        self.order.remove(&entry.stamp);
        entry.stamp = stamp;
        self.order.insert(stamp, name.to_string());
        let now = Held::of(&entry.tensor);
        let was = std::mem::replace(&mut entry.held, now);
        let tensor = entry.tensor.clone();
        self.held.host = self.held.host - was.host + now.host;
        self.held.device = self.held.device - was.device + now.device;
        self.evict_until(budgets, Held::default(), Some(stamp));
        Some(tensor)
    }

    /// Caches `t` (as most recently used), evicting the oldest entries until it fits.
    pub fn insert(&mut self, name: &str, t: Arc<Tensor>, budgets: Budgets) {
        let held = Held::of(&t);
        if !budgets.admits(held) {
            return;
        }
        if let Some(old) = self.entries.remove(name) {
            self.order.remove(&old.stamp);
            self.held.host -= old.held.host;
            self.held.device -= old.held.device;
        }
        self.evict_until(budgets, held, None);
        let stamp = self.stamp();
        self.order.insert(stamp, name.to_string());
        self.entries.insert(
            name.to_string(),
            Entry {
                tensor: t,
                held,
                stamp,
            },
        );
        self.held.host += held.host;
        self.held.device += held.device;
    }

    /// Evicts the oldest entries (but `keep`) until `extra` more bytes fit in `budgets`.
    fn evict_until(&mut self, budgets: Budgets, extra: Held, keep: Option<u64>) {
        let over = |h: Held| {
            h.host + extra.host > budgets.host || h.device + extra.device > budgets.device
        };
        while over(self.held) {
            let Some((&stamp, _)) = self.order.iter().find(|(s, _)| Some(**s) != keep) else {
                break;
            };
            let name = self.order.remove(&stamp).expect("found above");
            if let Some(old) = self.entries.remove(&name) {
                self.held.host -= old.held.host;
                self.held.device -= old.held.device;
            }
        }
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Bytes held now.
    pub fn held(&self) -> Held {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(n: usize) -> Arc<Tensor> {
        Arc::new(Tensor::from_vec(&[n], vec![1.0; n]))
    }

    const ROOMY: usize = usize::MAX;

    #[test]
    fn the_least_recently_used_goes_first() {
        let budgets = Budgets {
            host: 3 * 40,
            device: ROOMY,
        };
        let mut c = LruCache::default();
        for name in ["a", "b", "c"] {
            c.insert(name, t(10), budgets);
        }
        assert!(c.touch("a", budgets).is_some());
        c.insert("d", t(10), budgets);
        assert!(c.touch("b", budgets).is_none(), "b was the oldest");
        for name in ["a", "c", "d"] {
            assert!(c.touch(name, budgets).is_some(), "{name} stays");
        }
        assert_eq!(c.held().host, 120);
    }

    #[test]
    fn a_tensor_over_the_budget_is_not_cached_and_evicts_nothing() {
        let budgets = Budgets {
            host: 40,
            device: ROOMY,
        };
        let mut c = LruCache::default();
        c.insert("a", t(10), budgets);
        c.insert("big", t(11), budgets);
        assert!(c.touch("big", budgets).is_none());
        assert!(c.touch("a", budgets).is_some());
    }

    #[test]
    fn reinserting_a_name_does_not_count_it_twice() {
        let budgets = Budgets {
            host: ROOMY,
            device: ROOMY,
        };
        let mut c = LruCache::default();
        c.insert("a", t(10), budgets);
        c.insert("a", t(10), budgets);
        assert_eq!(c.held().host, 40);
    }

    #[test]
    fn a_device_copy_attached_later_counts_against_the_device_budget() {
        struct Fake(usize);
        impl crate::tensor::DeviceBuffer for Fake {
            fn address(&self) -> u64 {
                1
            }
            fn bytes(&self) -> usize {
                self.0
            }
            fn device_index(&self) -> usize {
                0
            }
            fn as_any(&self) -> &dyn std::any::Any {
                self
            }
            fn download(&self) -> crate::error::Result<Vec<f32>> {
                Ok(vec![0.0; self.0 / 4])
            }
        }
        let budgets = Budgets {
            host: ROOMY,
            device: 30,
        };
        let mut c = LruCache::default();
        let (a, b) = (t(10), t(10));
        c.insert("a", a.clone(), budgets);
        c.insert("b", b.clone(), budgets);
        a.attach_device(Arc::new(Fake(20)));
        assert!(c.touch("a", budgets).is_some());
        b.attach_device(Arc::new(Fake(20)));
        // Both copies are 40 bytes on the device: "a", the older, goes; "b" was just used.
        assert!(c.touch("b", budgets).is_some());
        assert!(c.touch("a", budgets).is_none());
        assert_eq!(c.held().device, 20);
    }
}
