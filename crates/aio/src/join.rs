//! [`Join`]: waits for the callbacks of `n` operations and hands their results, in order, to one
//! final closure. Used by [`crate::Engine::read_many`] and by the offloader's groups.

use std::sync::{Arc, Mutex, PoisonError};

/// Collects `n` results by position; the last one to arrive runs the final closure (on the
/// thread that delivered it) with every result in order.
pub(crate) struct Join<T, F> {
    state: Mutex<JoinState<T, F>>,
}

struct JoinState<T, F> {
    results: Vec<Option<T>>,
    left: usize,
    done: Option<F>,
}

impl<T, F: FnOnce(Vec<T>)> Join<T, F> {
    /// A join of `n` results. With `n == 0`, `done` runs at once, on the calling thread.
    pub(crate) fn new(n: usize, done: F) -> Arc<Self> {
        if n == 0 {
            done(Vec::new());
            return Arc::new(Join { state: Mutex::new(JoinState { results: Vec::new(), left: 0, done: None }) });
        }
        let results = (0..n).map(|_| None).collect();
        Arc::new(Join { state: Mutex::new(JoinState { results, left: n, done: Some(done) }) })
    }

    /// Delivers result `i`. Each position is delivered exactly once.
    pub(crate) fn put(&self, i: usize, value: T) {
        let finished = {
            let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            debug_assert!(s.results[i].is_none(), "result {i} delivered twice");
            s.results[i] = Some(value);
            s.left -= 1;
            if s.left > 0 {
                return;
            }
            let results: Vec<T> = s.results.drain(..).flatten().collect();
            s.done.take().map(|done| (done, results))
        };
        // Outside the lock: the closure may do anything, including panic.
        if let Some((done, results)) = finished {
            done(results);
        }
    }
}
