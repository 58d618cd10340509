//! Maglev consistent hashing (Eisenbud et al., NSDI 2016), computed here and only indexed by the
//! kernel, as Katran and Cilium do.
//!
//! A table of `M` (prime) slots maps a flow hash to a backend. Every node computes the same table
//! from the same backend set, whatever the order the backends arrive in, so a flow that lands on
//! another node (ECMP, a moved VIP) keeps its backend; and when one backend of N changes, only
//! about 1/N of the slots move.
//!
//! The reconciler programs one table per external frontend with `--lb-algorithm maglev`
//! (`proxy_abi::maglev::TABLE_SIZE` slots); the TC ingress program indexes it with
//! `proxy_abi::maglev::flow_hash`.

/// Table sizes the builder accepts: primes, as the algorithm needs. The kernel's is
/// `proxy_abi::maglev::TABLE_SIZE` (4093).
pub const TABLE_SIZES: [u32; 7] = [251, 509, 1021, 2039, 4093, 8191, 16381];

/// FNV-1a, 64 bit: stable across builds and machines (std's hashers are not).
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// SplitMix64's finaliser: a second, independent-looking hash from the first.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Builds the lookup table: `table[slot]` is an index into `backends`. `backends` are stable
/// identities (e.g. `ip:port`) and must not repeat; an empty list gives an empty table.
pub fn table(backends: &[String], size: u32) -> Vec<u32> {
    assert!(TABLE_SIZES.contains(&size), "Maglev table size {size} is not one of {TABLE_SIZES:?}");
    if backends.is_empty() {
        return Vec::new();
    }
    let m = u64::from(size);
    // Sorted, so that the order the backends were listed in does not matter.
    let mut order: Vec<usize> = (0..backends.len()).collect();
    order.sort_by(|a, b| backends[*a].cmp(&backends[*b]));
    let permutation: Vec<(u64, u64)> = order
        .iter()
        .map(|i| {
            let h = fnv1a64(backends[*i].as_bytes());
            (h % m, mix(h) % (m - 1) + 1)
        })
        .collect();

    let mut table = vec![u32::MAX; size as usize];
    let mut next = vec![0u64; order.len()];
    let mut filled = 0;
    'fill: loop {
        for (turn, (offset, skip)) in permutation.iter().enumerate() {
            // The backend's next preferred slot that is still free.
            let mut slot = ((offset + next[turn] * skip) % m) as usize;
            while table[slot] != u32::MAX {
                next[turn] += 1;
                slot = ((offset + next[turn] * skip) % m) as usize;
            }
            table[slot] = order[turn] as u32;
            next[turn] += 1;
            filled += 1;
            if filled == size as usize {
                break 'fill;
            }
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("10.244.{}.{}:8080", i / 200, i % 200 + 2)).collect()
    }

    fn counts(table: &[u32], n: usize) -> Vec<usize> {
        let mut counts = vec![0; n];
        for slot in table {
            counts[*slot as usize] += 1;
        }
        counts
    }

    #[test]
    fn every_backend_gets_an_even_share() {
        for (n, size) in [(1, 251), (2, proxy_abi::maglev::TABLE_SIZE), (3, 1021), (10, 1021), (100, 16381)] {
            let table = table(&names(n), size);
            assert_eq!(table.len(), size as usize);
            let counts = counts(&table, n);
            let (min, max) = (*counts.iter().min().unwrap(), *counts.iter().max().unwrap());
            // Backends fill in turns, so shares differ by at most one slot.
            assert!(max - min <= 1, "n={n} size={size}: shares from {min} to {max}");
        }
    }

    #[test]
    fn the_table_does_not_depend_on_the_order_of_the_backends() {
        let forward = names(7);
        let mut backward = forward.clone();
        backward.reverse();
        let by_name = |t: Vec<u32>, list: &[String]| t.into_iter().map(|i| list[i as usize].clone()).collect::<Vec<_>>();
        assert_eq!(by_name(table(&forward, 1021), &forward), by_name(table(&backward, 1021), &backward));
    }

    #[test]
    fn removing_one_backend_of_n_moves_little_more_than_its_own_slots() {
        let size = 16381;
        for n in [5, 10, 50] {
            let all = names(n);
            let before: Vec<String> = table(&all, size).into_iter().map(|i| all[i as usize].clone()).collect();
            let removed = &all[n / 2];
            let rest: Vec<String> = all.iter().filter(|b| *b != removed).cloned().collect();
            let after: Vec<String> = table(&rest, size).into_iter().map(|i| rest[i as usize].clone()).collect();
            // Slots of the removed backend must move; any other slot that moves is disruption.
            let disrupted = before.iter().zip(&after).filter(|(b, a)| *b != removed && b != a).count();
            let share = f64::from(size) / n as f64;
            eprintln!("n={n}: {disrupted} slots of remaining backends moved (own share {share:.0})");
            // The paper measures a few percent of the table at most; hold it to 3 %.
            assert!((disrupted as f64) < 0.03 * f64::from(size), "n={n}: {disrupted} of {size} slots disrupted");
        }
    }

    #[test]
    fn adding_a_backend_takes_its_share_mostly_from_every_other_backend() {
        let size = 4093;
        let old = names(9);
        let new = names(10);
        let before: Vec<&String> = table(&old, size).into_iter().map(|i| &old[i as usize]).collect();
        let after: Vec<&String> = table(&new, size).into_iter().map(|i| &new[i as usize]).collect();
        let moved = before.iter().zip(&after).filter(|(b, a)| b != a).count();
        let taken_by_new = after.iter().filter(|a| ***a == new[9]).count();
        // Minimal movement is exactly the new backend's share (~ size/10).
        assert!(moved <= taken_by_new + size as usize * 3 / 100, "{moved} moved, {taken_by_new} to the new backend");
    }

    #[test]
    fn no_backends_give_an_empty_table() {
        assert!(table(&[], 251).is_empty());
    }
}
