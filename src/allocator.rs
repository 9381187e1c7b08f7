//! What the binary's allocator (mimalloc, `src/main.rs`) is asked to do beyond allocating.

/// Gives memory that is free but still held back to the OS now.
///
/// mimalloc returns freed pages only as later allocations come by; a proxy that served 1000
/// streams and then idles makes too few of those, and stayed at the peak's resident size
/// (docs/proxy.md, "Memory"). Called when a burst is over (the legs' client dropping idle
/// connections), never per request: it walks the calling thread's heap and the arenas.
pub fn return_free_memory() {
    #[cfg(not(feature = "system-allocator"))]
    // SAFETY: mi_collect takes no pointers and may be called from any thread at any time.
    unsafe {
        libmimalloc_sys::mi_collect(true);
    }
}
