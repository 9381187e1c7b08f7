-- wrk script: POST one small zero-latency completion request per call. wrk itself
-- counts non-2xx/3xx answers (summary.errors.status); done() prints them with the
-- socket errors, so a fast stream of errors cannot pass for throughput. No per-response
-- Lua callback: it would slow the load generator down.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("SIM_BENCH_BODY") or '{"model":"sim-model","prompt":"San Francisco is a","max_tokens":16}'

done = function(summary, latency, requests)
  io.write(string.format("non-2xx or socket errors: %d\n",
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
