//! One client request through the PD pair: pick instances, send the legs in the order the
//! protocol asks for, retry a leg elsewhere on connect errors and 502/503, and hand back
//! either a complete answer or decode's stream with its first chunk already in hand (so a
//! decode that fails before its first byte is still a proper JSON error, never a 200).

use super::Proxy;
use super::errors::{LegError, LegFailure, ProxyError};
use super::instances::{FailureKind, Instance, Leg};
use super::legs::{AbortOnDrop, Answer, decode_bytes, decode_once, prefill_once};
use super::protocol::{Body, Flow, Handshake, choices};
use super::recompute::judgment::Expect;
use super::record::RequestRecord;
pub use super::request::ClientRequest;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// Metrics reason: n > 1 with a protocol whose handoff serves one decode only.
pub const MISS_MULTIPLE_CHOICES: &str = "n_gt_1_recomputed";

/// Runs the request through its legs. A request whose leg failed before any byte reached
/// its client (nothing is sent before this returns) for a reason another pair may not
/// have ([`super::errors::LegFailure::redo_reason`]: the KV load failed, a connection
/// refused or reset...) is redone once, both legs, on another prefill/decode pair (the
/// same one when it is the only one), under a request id of its own; counted by reason,
/// logged with both attempts. Its engines' `kv_load_failure_policy` is left as it is.
///
/// One budget covers every retry of a request before its first byte: `--retries` in
/// all, whether a leg is retried on its own, a pair is redone inside a flow, or the
/// whole request is redone here ([`budget_left`], spent in [`retrying`] and here; the
/// record's `retries` is what was spent). A stream's continuations after its first byte
/// have their own, `--migration-limit` ([`super::migration`]).
pub async fn run(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
) -> Result<Answer, ProxyError> {
    let first = run_once(proxy, req, rec).await;
    let Err(ProxyError::Leg(failed)) = &first else {
        return first;
    };
    let Some(reason) = failed.failure.redo_reason() else {
        return first;
    };
    if Instant::now() >= req.deadline || !budget_left(proxy, rec) {
        return first;
    }
    let pair = [rec.prefill.clone(), rec.decode.clone()];
    let mut again = req.clone();
    again.id = format!("{}-redo", req.id);
    again.avoid = pair.iter().flatten().cloned().collect();
    proxy.recorder.redone(reason);
    rec.retries += 1;
    tracing::warn!(
        request_id = %req.id,
        "request redone once ({reason}): the first attempt (prefill {}, decode {}) failed before any byte reached the client: {failed}",
        pair[0].as_deref().unwrap_or("-"),
        pair[1].as_deref().unwrap_or("-"),
    );
    let second = run_once(proxy, &again, rec).await;
    match &second {
        Ok(_) => tracing::info!(
            request_id = %req.id,
            "redone request answered on prefill {} and decode {} (second attempt, id {})",
            rec.prefill.as_deref().unwrap_or("-"),
            rec.decode.as_deref().unwrap_or("-"),
            again.id
        ),
        Err(e) => tracing::warn!(
            request_id = %req.id,
            "redone request failed again (second attempt, id {}): {e}",
            again.id
        ),
    }
    second
}

/// One attempt of the request through its legs.
async fn run_once(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
) -> Result<Answer, ProxyError> {
    let proto = &proxy.protocol;
    if choices(&req.body) > 1 && !proto.handles_multiple_choices() {
        tracing::warn!(
            request_id = %req.id,
            "n > 1: {} hands the KV to one decode request only, so decode recomputes the prompt (no prefill leg)",
            proto.name()
        );
        proxy.recorder.handoff_miss(MISS_MULTIPLE_CHOICES);
        rec.handoff_miss = Some(MISS_MULTIPLE_CHOICES);
        return decode_leg(proxy, req, rec, req.raw.clone(), Expect::Recompute).await;
    }
    match proto.flow() {
        Flow::Sequential => sequential(proxy, req, rec).await,
        Flow::Concurrent => concurrent(proxy, req, rec).await,
    }
}

/// Prefill, wait for it, then decode (two-step, nixl). A decode found unreachable before
/// it sent anything may have taken the KV the prefill handed over (or may yet): the pair
/// is redone, prefill and all, on instances still reachable.
async fn sequential(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
) -> Result<Answer, ProxyError> {
    let mut redone = 0;
    loop {
        match sequential_once(proxy, req, rec).await? {
            Ok(answer) => return Ok(answer),
            Err((inst, f)) => {
                retry_or_give_up(proxy, req, rec, Leg::Decode, &inst, f, redone).await?;
                redone += 1;
            }
        }
    }
}

/// One prefill (retried on its own) and its decode (retried on its own while the KV
/// handed over is still there); the inner Err is a decode found unreachable.
async fn sequential_once(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
) -> Result<Result<Answer, (Arc<Instance>, LegFailure)>, ProxyError> {
    let started = Instant::now();
    let (prefill, (handshake, answer)) =
        retry_leg(proxy, req, rec, Leg::Prefill, Partner::Any, |inst| {
            let proxy = proxy.clone();
            async move {
                let handshake = proxy.protocol.prepare(&inst, &proxy.upstream).await?;
                let body = proxy.protocol.prefill_body(&req.body, &req.id, &handshake);
                let answer =
                    prefill_once(proxy.clone(), inst, req.path, body, req.id.clone()).await?;
                Ok((handshake, answer))
            }
        })
        .await?;
    rec.prefill_time = Some(started.elapsed());
    let decode =
        proxy
            .protocol
            .decode_body(&req.body, &req.id, &prefill, &handshake, Some(&answer));
    let expect = if let Some(reason) = decode.handoff_miss {
        tracing::warn!(
            request_id = %req.id,
            prefill = %prefill.url,
            "KV handoff missed ({reason}): decode will recompute the prompt, so this request's TTFT is not disaggregated"
        );
        proxy.recorder.handoff_miss(reason);
        rec.handoff_miss = Some(reason);
        Expect::Recompute
    } else {
        Expect::handoff(&req.body, decode.body.as_ref())
    };
    let body = decode_bytes(decode.body, req, expect);
    let (inst, attempt) = retry_leg(
        proxy,
        req,
        rec,
        Leg::Decode,
        Partner::Of(&prefill),
        |inst| {
            let body = body.clone();
            async move {
                match decode_once(proxy, req, inst, body, expect).await {
                    Err(f @ LegFailure::Unreachable(_)) => Ok(Err(f)),
                    other => other.map(Ok),
                }
            }
        },
    )
    .await?;
    Ok(match attempt {
        Ok((answer, first_byte)) => {
            rec.decode_first_byte = first_byte;
            note_recompute(rec, &answer);
            Ok(answer)
        }
        Err(f) => Err((inst, f)),
    })
}

/// Both legs at once (mooncake), retried as a pair on other instances while that helps.
async fn concurrent(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
) -> Result<Answer, ProxyError> {
    let mut tried_prefill = Vec::new();
    let mut tried_decode = Vec::new();
    let mut attempt = 0;
    loop {
        let prefill = choose(proxy, req, Leg::Prefill, &tried_prefill, Partner::Any).await?;
        tried_prefill.push(prefill.index);
        rec.set_instance(Leg::Prefill, &prefill.url);
        let failure = match proxy.protocol.prepare(&prefill, &proxy.upstream).await {
            Err(f) => (Leg::Prefill, prefill.clone(), f),
            Ok(handshake) => {
                let decode = choose(
                    proxy,
                    req,
                    Leg::Decode,
                    &tried_decode,
                    Partner::Of(&prefill),
                )
                .await?;
                tried_decode.push(decode.index);
                rec.set_instance(Leg::Decode, &decode.url);
                match both_legs(proxy, req, rec, &prefill, &decode, &handshake).await {
                    Ok(answer) => return Ok(answer),
                    Err(failure) => failure,
                }
            }
        };
        // Leaving the block above dropped the other leg (decode or background prefill).
        let (leg, inst, f) = failure;
        retry_or_give_up(proxy, req, rec, leg, &inst, f, attempt).await?;
        attempt += 1;
    }
}

/// One attempt of both legs at once: prefill in the background, decode awaited. A failed
/// prefill cancels the decode (it would wait for KV that never comes); a decode stream that
/// starts before prefill has answered keeps the prefill running, watched. Err names the
/// leg that failed.
async fn both_legs(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
    prefill: &Arc<Instance>,
    decode: &Arc<Instance>,
    handshake: &Handshake,
) -> Result<Answer, (Leg, Arc<Instance>, LegFailure)> {
    let pbody = proxy.protocol.prefill_body(&req.body, &req.id, handshake);
    if handshake.learn_first {
        return learn_then_decode(proxy, req, rec, prefill, decode, handshake, pbody).await;
    }
    let dbody = proxy
        .protocol
        .decode_body(&req.body, &req.id, prefill, handshake, None);
    let expect = Expect::handoff(&req.body, dbody.body.as_ref());
    let dbytes = decode_bytes(dbody.body, req, expect);
    let started = Instant::now();
    let mut background = AbortOnDrop(tokio::spawn(prefill_once(
        proxy.clone(),
        prefill.clone(),
        req.path,
        pbody,
        req.id.clone(),
    )));
    let decoding = decode_once(proxy, req, decode.clone(), dbytes, expect);
    tokio::pin!(decoding);
    let mut prefill_done = false;
    loop {
        tokio::select! {
            done = &mut background.0, if !prefill_done => match done {
                Ok(Ok(answer)) => {
                    proxy.protocol.learned(prefill, &answer);
                    prefill_done = true;
                    rec.prefill_time = Some(started.elapsed());
                }
                Ok(Err(f)) => return Err((Leg::Prefill, prefill.clone(), f)),
                Err(e) => {
                    let f = LegFailure::Body(format!("prefill task ended: {e}"));
                    return Err((Leg::Prefill, prefill.clone(), f));
                }
            },
            answer = &mut decoding => {
                let (mut answer, first_byte) = answer.map_err(|f| {
                    if matches!(f, LegFailure::KvLoad { .. }) {
                        // What decode was told of the prefill may be stale (a restart).
                        proxy.protocol.forget(prefill);
                    }
                    (Leg::Decode, decode.clone(), f)
                })?;
                rec.decode_first_byte = first_byte;
                note_recompute(rec, &answer);
                if let Answer::Stream { keep, .. } = &mut answer
                    && !prefill_done
                {
                    keep.prefill = Some(watch_background_prefill(
                        proxy.clone(),
                        prefill.clone(),
                        background,
                        req.id.clone(),
                    ));
                }
                return Ok(answer);
            }
        }
    }
}

/// A concurrent protocol's attempt on a prefill it does not know yet (nixl-push): prefill
/// first, then decode with what it answered, as a sequential flow does.
async fn learn_then_decode(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
    prefill: &Arc<Instance>,
    decode: &Arc<Instance>,
    handshake: &Handshake,
    pbody: Body,
) -> Result<Answer, (Leg, Arc<Instance>, LegFailure)> {
    let started = Instant::now();
    let answer = prefill_once(
        proxy.clone(),
        prefill.clone(),
        req.path,
        pbody,
        req.id.clone(),
    )
    .await
    .map_err(|f| (Leg::Prefill, prefill.clone(), f))?;
    rec.prefill_time = Some(started.elapsed());
    proxy.protocol.learned(prefill, &answer);
    let dbody = proxy
        .protocol
        .decode_body(&req.body, &req.id, prefill, handshake, Some(&answer));
    let expect = match dbody.handoff_miss {
        Some(reason) => {
            proxy.recorder.handoff_miss(reason);
            rec.handoff_miss = Some(reason);
            Expect::Recompute
        }
        None => Expect::handoff(&req.body, dbody.body.as_ref()),
    };
    let dbytes = decode_bytes(dbody.body, req, expect);
    let (answer, first_byte) = decode_once(proxy, req, decode.clone(), dbytes, expect)
        .await
        .map_err(|f| (Leg::Decode, decode.clone(), f))?;
    rec.decode_first_byte = first_byte;
    note_recompute(rec, &answer);
    Ok(answer)
}

/// Keeps a prefill that is still running once decode's stream has begun: its failure is
/// still the instance's (counted, logged, its engine id forgotten), and it is cancelled
/// when the stream is dropped, since dropping the watcher drops `background`.
fn watch_background_prefill(
    proxy: Arc<Proxy>,
    inst: Arc<Instance>,
    mut background: AbortOnDrop,
    request_id: String,
) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(async move {
        let result = match (&mut background.0).await {
            Ok(r) => r,
            Err(e) => Err(LegFailure::Body(format!("prefill task ended: {e}"))),
        };
        if let Err(f) = &result {
            blame(&proxy, Leg::Prefill, &inst, f);
            tracing::warn!(
                request_id = %request_id,
                "prefill leg on {} failed while decode was already streaming: {f}",
                inst.url
            );
        }
        result
    }))
}

/// A whole answer whose usage showed a recompute marks the request's log line.
fn note_recompute(rec: &mut RequestRecord, answer: &Answer) {
    if let Answer::Full {
        recompute: Some(reason),
        ..
    } = answer
    {
        rec.handoff_miss = Some(reason);
    }
}

/// Sends the decode leg (with retries) and returns its answer.
async fn decode_leg(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
    body: Bytes,
    expect: Expect,
) -> Result<Answer, ProxyError> {
    let (_, (answer, first_byte)) =
        retry_leg(proxy, req, rec, Leg::Decode, Partner::None, |inst| {
            decode_once(proxy, req, inst, body.clone(), expect)
        })
        .await?;
    rec.decode_first_byte = first_byte;
    note_recompute(rec, &answer);
    Ok(answer)
}

/// Which instance the other leg of a request goes to, for routing only pairs whose KV
/// path is warmed (warmup.rs).
#[derive(Clone, Copy)]
enum Partner<'a> {
    /// Not chosen yet: any instance in a warmed pair.
    Any,
    /// This one: only instances warmed with it.
    Of(&'a Instance),
    /// No KV handoff (decode alone recomputes): any usable instance.
    None,
}

/// Runs `attempt` on an instance of `leg`, then on others while it fails in a retryable way.
async fn retry_leg<T, F, Fut>(
    proxy: &Arc<Proxy>,
    req: &ClientRequest,
    rec: &mut RequestRecord,
    leg: Leg,
    partner: Partner<'_>,
    mut attempt: F,
) -> Result<(Arc<Instance>, T), ProxyError>
where
    F: FnMut(Arc<Instance>) -> Fut,
    Fut: Future<Output = Result<T, LegFailure>>,
{
    let mut tried = Vec::new();
    let mut n = 0;
    loop {
        let inst = choose(proxy, req, leg, &tried, partner).await?;
        tried.push(inst.index);
        rec.set_instance(leg, &inst.url);
        match attempt(inst.clone()).await {
            Ok(t) => return Ok((inst, t)),
            Err(f) => {
                retry_or_give_up(proxy, req, rec, leg, &inst, f, n).await?;
                n += 1;
            }
        }
    }
}

/// Whether the request's one budget of retries before its first byte (`--retries`) has
/// some left.
fn budget_left(proxy: &Proxy, rec: &RequestRecord) -> bool {
    rec.retries < proxy.settings().retries
}

fn may_retry(proxy: &Proxy, req: &ClientRequest, rec: &RequestRecord, f: &LegFailure) -> bool {
    f.is_retryable() && budget_left(proxy, rec) && Instant::now() < req.deadline
}

/// The wait before a leg is tried again: 25 ms after its first failure, doubling, at most
/// 400 ms (a request's whole budget is seconds, and another instance is usually at hand).
const RETRY_BACKOFF: crate::backoff::Backoff =
    crate::backoff::Backoff::new(Duration::from_millis(25), Duration::from_millis(400));

/// After a leg failed on `inst`: blames the instance, then either waits out the backoff
/// before the next attempt (Ok) or gives the failure up as the request's error.
async fn retry_or_give_up(
    proxy: &Proxy,
    req: &ClientRequest,
    rec: &mut RequestRecord,
    leg: Leg,
    inst: &Instance,
    f: LegFailure,
    attempt: u32,
) -> Result<(), ProxyError> {
    blame(proxy, leg, inst, &f);
    if !may_retry(proxy, req, rec, &f) {
        return Err(LegError {
            leg,
            instance: inst.url.clone(),
            failure: f,
        }
        .into());
    }
    retrying(proxy, req, rec, leg, inst, &f, attempt).await;
    Ok(())
}

/// Counts a failure against the instance; a failed prefill's cached engine id is
/// forgotten (it may have restarted).
fn blame(proxy: &Proxy, leg: Leg, inst: &Instance, f: &LegFailure) {
    note_failure(inst, f);
    if leg == Leg::Prefill {
        proxy.protocol.forget(inst);
    }
}

/// Counts and logs a retry, then waits a short, growing backoff ([`RETRY_BACKOFF`]).
async fn retrying(
    proxy: &Proxy,
    req: &ClientRequest,
    rec: &mut RequestRecord,
    leg: Leg,
    inst: &Instance,
    f: &LegFailure,
    attempt: u32,
) {
    proxy.recorder.retry(leg);
    rec.retries += 1;
    let backoff = RETRY_BACKOFF.after(attempt.saturating_add(1));
    tracing::warn!(request_id = %req.id, "{leg} leg failed on {}: {f}; retrying in {backoff:?}", inst.url);
    tokio::time::sleep_until((Instant::now() + backoff).min(req.deadline)).await;
}

/// Picks the instance for a leg as [`choose_now`] does; when none is usable but the
/// supervisor reports one starting or restarting, or a pair's KV path is being warmed,
/// waits for it (up to `--restart-wait-s` and the request's own deadline) instead of
/// failing at once.
async fn choose(
    proxy: &Proxy,
    req: &ClientRequest,
    leg: Leg,
    tried: &[usize],
    partner: Partner<'_>,
) -> Result<Arc<Instance>, ProxyError> {
    let give_up = (Instant::now() + proxy.settings().restart_wait).min(req.deadline);
    let mut said = false;
    loop {
        let err = match choose_now(proxy, req, leg, tried, partner) {
            Err(e @ ProxyError::NoInstance { .. }) => e,
            done => return done,
        };
        let pools = proxy.pools.snapshot();
        let pool = pools.of(leg);
        // Usable instances kept out only by the warm-up: wait while a pair may still be
        // warmed (one warming, due again, or an instance of the other leg coming or in).
        let other = pools.of(match leg {
            Leg::Prefill => Leg::Decode,
            Leg::Decode => Leg::Prefill,
        });
        let warming = proxy.warmup.needed()
            && pool.iter().any(|i| i.is_usable())
            && (proxy.warmup.pending()
                || other.iter().any(|i| i.is_usable() || i.is_coming_back()));
        let awaited = match pool.iter().find(|i| i.is_coming_back()) {
            Some(i) => i.url.clone(),
            None if warming => "a pair whose KV path is being warmed up".to_string(),
            None => return Err(err),
        };
        if Instant::now() >= give_up {
            return Err(err);
        }
        if !said {
            said = true;
            proxy.recorder.restart_wait(leg);
            tracing::info!(
                request_id = %req.id,
                "no healthy {leg} instance; waiting up to {:?} for {awaited}, which is coming back",
                give_up.saturating_duration_since(Instant::now()),
            );
        }
        tokio::time::sleep(RESTART_POLL.min(give_up.saturating_duration_since(Instant::now())))
            .await;
    }
}

/// How often a request waiting for a restarting instance looks again.
const RESTART_POLL: Duration = Duration::from_millis(25);

/// Picks the instance for a leg: the designated one, or the policy's choice among usable
/// instances not tried yet (all usable ones once every one was tried). The lists come
/// prepared from the ready-pair index ([`super::warmup::ReadyIndex`]): a first attempt
/// costs the same at 64P64D as at 1P1D and allocates nothing by the pool's size; only a
/// retry or a redone request filters a list.
fn choose_now(
    proxy: &Proxy,
    req: &ClientRequest,
    leg: Leg,
    tried: &[usize],
    partner: Partner<'_>,
) -> Result<Arc<Instance>, ProxyError> {
    if let Some(pinned) = req.designation.of(leg) {
        return Ok(pinned.clone());
    }
    let index = proxy.warmup.ready(&proxy.pools);
    if index.usable(leg).is_empty() {
        let pools = proxy.pools.snapshot();
        let states: Vec<String> = pools
            .of(leg)
            .iter()
            .map(|i| format!("{} ({})", i.url, i.out_reason()))
            .collect();
        return Err(ProxyError::NoInstance {
            leg,
            detail: states.join(", "),
        });
    }
    let usable = warmed(proxy, &index, leg, partner);
    if usable.is_empty() {
        return Err(ProxyError::NoInstance {
            leg,
            detail: proxy.warmup.why_not(leg),
        });
    }
    let policy = proxy.policy(leg);
    if tried.is_empty() && req.avoid.is_empty() {
        return Ok(policy.pick(usable, &req.facts));
    }
    let fresh: Vec<Arc<Instance>> = usable
        .iter()
        .filter(|i| !tried.contains(&i.index))
        .cloned()
        .collect();
    // A redone request goes elsewhere than its failed attempt where another is usable.
    let elsewhere: Vec<Arc<Instance>> = fresh
        .iter()
        .filter(|i| !req.avoid.contains(&i.url))
        .cloned()
        .collect();
    let candidates = if !elsewhere.is_empty() {
        &elsewhere
    } else if fresh.is_empty() {
        usable
    } else {
        &fresh
    };
    Ok(policy.pick(candidates, &req.facts))
}

/// The usable instances of `leg` that make a warmed pair: with `partner` when it is
/// chosen, with any usable instance of the other leg while it is not; all of them when
/// the protocol needs no warm-up or the request no handoff.
fn warmed<'a>(
    proxy: &Proxy,
    index: &'a super::warmup::ReadyIndex,
    leg: Leg,
    partner: Partner<'_>,
) -> &'a [Arc<Instance>] {
    if !proxy.warmup.needed() {
        return index.usable(leg);
    }
    match partner {
        Partner::None => index.usable(leg),
        Partner::Of(p) => index.partners_of(p),
        Partner::Any => index.paired(leg),
    }
}

/// Counts a failure against the instance (never a client's 4xx) and takes an instance that
/// refuses connections out of rotation until health checks bring it back. A connect that
/// timed out only counts: the engine or its machine is busy (a freeze on a loaded host
/// stalls connects for seconds), and the health checks tell busy from gone.
fn note_failure(inst: &Instance, f: &LegFailure) {
    if !f.blames_instance() {
        return;
    }
    let kind = match f {
        LegFailure::Connect(_) | LegFailure::ConnectTimeout(_) => FailureKind::Connect,
        LegFailure::Timeout { .. } | LegFailure::Unreachable(_) => FailureKind::Timeout,
        LegFailure::Status { .. } => FailureKind::Status5xx,
        LegFailure::Body(_)
        | LegFailure::BadAnswer(_)
        | LegFailure::Bootstrap { .. }
        | LegFailure::KvLoad { .. } => FailureKind::Body,
    };
    inst.record_failure(kind);
    if !matches!(f, LegFailure::Connect(_)) {
        return;
    }
    // Nothing listens there: whatever answers next is a new run of the engine.
    inst.run.ended();
    if inst.set_usable(false) {
        // A supervised engine that refuses connections has most likely died, and its
        // supervisor is restarting it: requests may wait for it until its next report
        // says otherwise (`failed`, or healthy again).
        if inst.is_supervised() {
            inst.set_coming_back(true);
        }
        inst.set_out_reason(&format!("refused a connection ({f})"));
        tracing::warn!(
            "{} instance {} refused a connection ({f}); not routing to it until health checks pass",
            inst.leg,
            inst.url
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::child_config::proxy::test_args;

    fn request() -> ClientRequest {
        ClientRequest {
            path: "/v1/completions",
            body: Body::new(),
            raw: Bytes::from_static(b"{}"),
            stream: false,
            id: "r".into(),
            designation: Default::default(),
            facts: Default::default(),
            deadline: Instant::now() + Duration::from_secs(30),
            avoid: Vec::new(),
            migration: super::super::request::Migration::Off,
        }
    }

    /// Two prefills and two decodes under nixl (pairs warmed before routing uses them).
    fn proxy() -> Proxy {
        let more = [
            "--prefill",
            "127.0.0.1:3",
            "--decode",
            "127.0.0.1:4",
            "--protocol",
            "nixl",
            "--policy",
            "round-robin",
        ];
        Proxy::new(&test_args(&more)).unwrap()
    }

    fn pick(p: &Proxy, leg: Leg, partner: Partner<'_>) -> String {
        choose_now(p, &request(), leg, &[], partner)
            .unwrap()
            .url
            .clone()
    }

    #[test]
    fn routing_picks_only_warmed_pairs_while_one_is_ready() {
        let p = proxy();
        let pools = p.pools.snapshot();
        let (p0, p1) = (&pools.prefill[0], &pools.prefill[1]);
        let (d0, d1) = (&pools.decode[0], &pools.decode[1]);
        let none = choose_now(&p, &request(), Leg::Prefill, &[], Partner::Any);
        assert!(
            matches!(none, Err(ProxyError::NoInstance { .. })),
            "no pair warmed: no prefill"
        );
        p.warmup.mark_ready(p1, d0);
        for _ in 0..4 {
            assert_eq!(pick(&p, Leg::Prefill, Partner::Any), p1.url);
            assert_eq!(pick(&p, Leg::Decode, Partner::Of(p1)), d0.url);
        }
        assert!(
            choose_now(&p, &request(), Leg::Decode, &[], Partner::Of(p0)).is_err(),
            "p0 makes no warmed pair"
        );
        // Without a handoff any usable decode goes.
        let both: std::collections::BTreeSet<String> = (0..4)
            .map(|_| pick(&p, Leg::Decode, Partner::None))
            .collect();
        assert_eq!(both.len(), 2);
        // A second warmed pair shares the prefills; the decode out of rotation drops out.
        p.warmup.mark_ready(p0, d1);
        let prefills: std::collections::BTreeSet<String> = (0..4)
            .map(|_| pick(&p, Leg::Prefill, Partner::Any))
            .collect();
        assert_eq!(prefills.len(), 2);
        d1.set_usable(false);
        for _ in 0..4 {
            assert_eq!(pick(&p, Leg::Prefill, Partner::Any), p1.url);
        }
        // A retry goes to an untried instance where one is left, else to a tried one.
        d1.set_usable(true);
        let retry = choose_now(&p, &request(), Leg::Prefill, &[p0.index], Partner::Any);
        assert_eq!(retry.unwrap().url, p1.url);
        let all = [p0.index, p1.index];
        assert!(choose_now(&p, &request(), Leg::Prefill, &all, Partner::Any).is_ok());
    }
}
