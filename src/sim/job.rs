//! One generation request while it runs: admission, prefill (prefix cache, KV handoff,
//! time to first token), decode steps, and the bookkeeping when it ends. Streaming and
//! whole answers drive the same [`Job`]. Dropping a job before [`Job::finish`] is how a
//! client disconnect aborts it: its guard counts the abort and frees its slots.

use super::cache::block_hashes;
use super::engine::{RunGuard, Sim, pause};
use super::generate::Pieces;
use super::handoff::{self, Incoming, Producer};
use super::metrics::Finish;
use super::openai::response::Usage;
use super::openai::{Endpoint, GenRequest};
use crate::topology::KvLoadFailurePolicy;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One output sequence (a choice).
pub struct Seq {
    /// The choice index in the answer (prompt index * n + choice).
    pub index: u32,
    prompt_len: u32,
    pieces: Pieces,
    max_tokens: u32,
    pub text: String,
    sent: usize,
    /// The generated tokens' ids, and where each one's text ends in `text`.
    pub ids: Vec<u32>,
    ends: Vec<usize>,
    /// How many of `ids` went out in stream chunks.
    ids_sent: usize,
    pub generated: u32,
    pub finish: Option<Finish>,
    pub stop_reason: Option<String>,
    /// The stream chunk with this sequence's finish_reason has gone out.
    pub reported: bool,
    trim_first: bool,
}

impl Seq {
    fn advance(&mut self, req: &GenRequest, max_stop_len: usize) {
        let (mut piece, id) = self.pieces.next_piece();
        if self.trim_first && self.generated == 0 {
            piece = piece.trim_start();
        }
        self.generated += 1;
        let before = self.text.len();
        self.text.push_str(piece);
        self.ids.push(id);
        self.ends.push(self.text.len());
        if !req.stop.is_empty() && self.generated >= req.min_tokens {
            let from = before.saturating_sub(max_stop_len.saturating_sub(1));
            let hit = req
                .stop
                .iter()
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| (p, s)))
                .min_by_key(|(p, _)| *p);
            if let Some((pos, stop)) = hit {
                let keep = if req.include_stop_str_in_output {
                    stop.len()
                } else {
                    0
                };
                self.text.truncate(from + pos + keep);
                self.sent = self.sent.min(self.text.len());
                self.finish = Some(Finish::Stop);
                self.stop_reason = Some(stop.clone());
                return;
            }
        }
        if self.generated >= self.max_tokens {
            self.finish = Some(Finish::Length);
        } else if !req.ignore_eos
            && self.generated >= req.min_tokens
            && self.pieces.already + self.generated >= self.pieces.natural
        {
            self.finish = Some(Finish::Stop);
        }
    }

    /// The range of text not sent yet, keeping back `hold_back` bytes that could start a stop string
    /// (all of it once finished).
    pub fn take_delta(&mut self, hold_back: usize) -> std::ops::Range<usize> {
        let upto = if self.finish.is_some() {
            self.text.len()
        } else {
            self.text.len().saturating_sub(hold_back)
        }
        .max(self.sent);
        let start = self.sent;
        self.sent = upto;
        start..upto
    }

    /// The ids of the tokens whose text has gone out since the last call (vLLM's
    /// `token_ids` of a stream chunk, with `return_token_ids`).
    pub fn take_ids(&mut self) -> std::ops::Range<usize> {
        let upto = self.ends.partition_point(|end| *end <= self.sent);
        let from = self.ids_sent.min(upto);
        self.ids_sent = upto;
        from..upto
    }

    /// `finish_reason` as the API spells it.
    pub fn finish_reason(&self) -> Option<&'static str> {
        self.finish.map(|f| match f {
            Finish::Stop => "stop",
            Finish::Length => "length",
        })
    }
}

/// A running request.
pub struct Job {
    pub sim: Arc<Sim>,
    pub req: GenRequest,
    pub id: String,
    pub created: u64,
    arrived: Instant,
    guard: Option<RunGuard>,
    producer: Option<Producer>,
    pub seqs: Vec<Seq>,
    pub prompt_tokens: u64,
    /// Prompt tokens not computed here (local prefix cache plus KV handoff).
    pub cached_tokens: u64,
    /// Bytes of text held back in streams while stop strings could still match.
    pub hold_back: usize,
    max_stop_len: usize,
    first_token: Option<Instant>,
    /// When the last step produced its tokens (the inter-token histogram's last mark).
    last_token: Option<Instant>,
    finished: bool,
    /// A KV handoff could not be loaded and the policy is "fail": the request ends with
    /// vLLM's generation error instead of being computed.
    pub kv_load_failed: bool,
}

impl Drop for Job {
    fn drop(&mut self) {
        // Once admitted, the run guard counts an abort; before that (still waiting for
        // a slot) the job does.
        if !self.finished && self.guard.is_none() {
            self.sim.metrics.aborted.fetch_add(1, Relaxed);
            tracing::info!("request aborted while waiting: the client went away");
        }
    }
}

impl Job {
    /// A job for a checked request; nothing runs until [`prefill`](Self::prefill).
    pub fn new(sim: Arc<Sim>, req: GenRequest, id: String, arrived: Instant) -> Job {
        let max_model_len = sim.args.model_params.max_model_len;
        let mut seqs = Vec::with_capacity(req.prompts.len() * req.n as usize);
        for (p, tokens) in req.prompts.iter().enumerate() {
            let len = tokens.len() as u32;
            for c in 0..req.n {
                seqs.push(Seq {
                    index: p as u32 * req.n + c,
                    prompt_len: len,
                    pieces: Pieces::new(tokens, c),
                    max_tokens: req
                        .max_tokens
                        .unwrap_or(max_model_len.saturating_sub(len))
                        .max(1),
                    text: String::new(),
                    sent: 0,
                    ids: Vec::new(),
                    ends: Vec::new(),
                    ids_sent: 0,
                    generated: 0,
                    finish: None,
                    stop_reason: None,
                    reported: false,
                    trim_first: req.endpoint == Endpoint::Chat,
                });
            }
        }
        let max_stop_len = req.stop.iter().map(String::len).max().unwrap_or(0);
        Job {
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
            hold_back: max_stop_len.saturating_sub(1),
            max_stop_len,
            prompt_tokens: req.prompts.iter().map(|p| p.len() as u64).sum(),
            cached_tokens: 0,
            sim,
            req,
            id,
            arrived,
            guard: None,
            producer: None,
            seqs,
            first_token: None,
            last_token: None,
            finished: false,
            kv_load_failed: false,
        }
    }

    /// Waits for a slot, looks up the prefix cache, takes or gives KV handoffs, and
    /// waits the time to first token.
    pub async fn prefill(&mut self) {
        let sim = self.sim.clone();
        let mut guard = sim.admit(self.seqs.len() as u32).await;
        let bs = sim.args.model_params.block_size as usize;
        let m = &sim.metrics;
        let (mut uncached, mut loaded, mut blocks) = (0u64, 0u64, 0i64);
        let mut all_hashes = Vec::with_capacity(self.req.prompts.len());
        for tokens in &self.req.prompts {
            let len = tokens.len() as u64;
            let hashes = block_hashes(tokens, bs);
            // As vLLM: the prompt's last token is always computed (its logits give the first
            // output token), so the prefix cache and a KV handoff cover at most the whole
            // blocks before it; a prompt of whole blocks computes its last block.
            let reusable = &hashes[..tokens.len().saturating_sub(1) / bs.max(1)];
            let local = sim.cache_lookup(reusable);
            let cached = (local * bs) as u64;
            let kv = self.req.kv.as_ref();
            let incoming = handoff::receive(&sim, kv, tokens, reusable, local, &self.id).await;
            let got = match incoming {
                Incoming::Received { tokens } => tokens,
                Incoming::NotExpected | Incoming::Missed => 0,
            };
            if incoming == Incoming::Missed
                && sim.args.kv_load_failure_policy == KvLoadFailurePolicy::Fail
            {
                m.external_lookup(len - cached, 0);
                m.kv_load_failures.fetch_add(1, Relaxed);
                tracing::warn!(
                    "KV load failed for {} and kv_load_failure_policy is fail: the request ends with an error instead of recomputing",
                    self.id
                );
                self.kv_load_failed = true;
                self.guard = Some(guard);
                return;
            }
            if incoming != Incoming::NotExpected {
                m.external_lookup(len - cached, got);
            }
            if let Some(p) = handoff::send(&sim, kv, tokens, &hashes, &self.id).await {
                self.producer = Some(p);
            }
            let computed = len - cached - got;
            uncached += computed;
            loaded += got;
            // vLLM's cached_tokens counts KV from the local cache and from a connector alike.
            self.cached_tokens += cached + got;
            m.prompt_by_source(computed, cached, got);
            m.prompt_tokens.fetch_add(len, Relaxed);
            m.prefix_queries.fetch_add(len, Relaxed);
            m.prefix_hits.fetch_add(cached, Relaxed);
            blocks += len.div_ceil(bs as u64) as i64 * i64::from(self.req.n);
            all_hashes.push(hashes);
        }
        guard.add_blocks(blocks);
        self.guard = Some(guard);
        sim.prefill(uncached, loaded).await;
        for h in &all_hashes {
            sim.cache_insert(h);
        }
    }

    /// Generates one token for every unfinished sequence (after one step's time, except
    /// for the first token). False when every sequence had already finished.
    pub async fn step(&mut self) -> bool {
        if self.seqs.iter().all(|s| s.finish.is_some()) {
            return false;
        }
        if self.first_token.is_some() {
            pause(self.sim.step_time()).await;
        }
        let bs = self.sim.args.model_params.block_size.max(1);
        let (mut new_blocks, mut made) = (0, 0u64);
        for s in self.seqs.iter_mut().filter(|s| s.finish.is_none()) {
            let before = s.generated;
            s.advance(&self.req, self.max_stop_len);
            made += u64::from(s.generated - before);
            if (s.prompt_len + s.generated) % bs == 1 {
                new_blocks += 1;
            }
        }
        // As vLLM, whose counter grows with every step, not once a request ends: a watcher
        // sees a long answer being written.
        self.sim.metrics.generation_tokens.fetch_add(made, Relaxed);
        if let Some(g) = &mut self.guard {
            g.add_blocks(new_blocks);
        }
        let now = Instant::now();
        self.first_token.get_or_insert(now);
        if let Some(last) = self.last_token.replace(now) {
            self.sim.metrics.itl.observe(now - last);
        }
        true
    }

    /// Counts the finished request, frees its slots, hands KV over if it is a prefill
    /// leg; returns the `kv_transfer_params` for the answer, if any.
    pub fn finish(&mut self) -> Option<serde_json::Value> {
        let sim = self.sim.clone();
        let m = &sim.metrics;
        for s in &self.seqs {
            m.finished(s.finish.unwrap_or(Finish::Length));
        }
        if let Some(t) = self.first_token {
            m.ttft.observe(t - self.arrived);
        }
        m.e2e.observe(self.arrived.elapsed());
        if let Some(mut g) = self.guard.take() {
            g.finish();
        }
        self.finished = true;
        let finish = self
            .seqs
            .first()
            .and_then(|s| s.finish)
            .unwrap_or(Finish::Length);
        let kv = self.producer.take().and_then(|p| p.complete(finish));
        if sim.faults.count_served() {
            tracing::error!(
                "fault injection: served {} requests (--fault-exit-after), exiting with status 1",
                sim.args.fault_exit_after.unwrap_or_default()
            );
            exit_soon(1);
        }
        kv
    }

    /// Ends a request whose KV could not be loaded (policy "fail"): frees its slot, counts
    /// it, and gives vLLM's error for it (`GenerationError`: finish reason "error").
    pub fn fail_kv_load(&mut self) -> super::openai::ApiError {
        if let Some(mut g) = self.guard.take() {
            g.finish();
        }
        self.finished = true;
        self.producer = None;
        kv_load_error()
    }

    /// Token counts for the answer.
    pub fn usage(&self) -> Usage {
        let completion = self.seqs.iter().map(|s| u64::from(s.generated)).sum();
        Usage::new(self.prompt_tokens, completion, self.cached_tokens)
    }
}

/// Exits with `status` shortly, so the answer in flight still goes out.
pub fn exit_soon(status: i32) {
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        std::process::exit(status);
    });
}

/// What vLLM 0.33's OpenAI server answers for a request finished with an error (as a
/// KV load failure under kv_load_failure_policy "fail" is): `GenerationError("Internal
/// server error")`, a 500 whose message does not say why.
pub fn kv_load_error() -> super::openai::ApiError {
    super::openai::ApiError::status(
        axum::http::StatusCode::INTERNAL_SERVER_ERROR,
        "Internal server error",
    )
}
