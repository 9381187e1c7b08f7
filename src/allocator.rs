//! What the binary's allocator (mimalloc, `src/main.rs`) is asked to do beyond allocating.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

/// Gives memory that is free but still held back to the OS now.
///
/// mimalloc returns freed pages only as later allocations come by; a proxy that served 1000
/// streams and then idles makes too few of those, and stayed at the peak's resident size
/// (docs/proxy.md, "Memory"). Called when a burst is over (the legs' client dropping idle
/// connections), never per request: it walks the calling thread's heap and the arenas.
pub fn return_free_memory() {
    BURSTS_OVER.fetch_add(1, Ordering::Relaxed);
    collect(true);
}

/// How many times a burst was declared over; each worker thread collects its own heap once
/// per new value ([`on_thread_park`]).
static BURSTS_OVER: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The value of [`BURSTS_OVER`] this thread last collected for.
    static COLLECTED_FOR: Cell<u64> = const { Cell::new(0) };
}

/// For tokio's `on_thread_park`: a worker thread going idle after a burst was declared over
/// hands back the free memory its own heap holds (mimalloc keeps freed pages per thread, so
/// the sweeping thread's collection alone left the other workers' pages resident). Costs one
/// atomic load per park otherwise.
pub fn on_thread_park() {
    let now = BURSTS_OVER.load(Ordering::Relaxed);
    let due = COLLECTED_FOR.with(|c| c.replace(now) != now);
    if due {
        collect(false);
    }
}

fn collect(force: bool) {
    #[cfg(not(feature = "system-allocator"))]
    // SAFETY: mi_collect takes no pointers and may be called from any thread at any time.
    unsafe {
        libmimalloc_sys::mi_collect(force);
    }
    #[cfg(feature = "system-allocator")]
    let _ = force;
}
