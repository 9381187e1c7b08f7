-- wrk script: POST one small zero-latency completion request per call and count
-- non-200 answers, so a fast stream of errors cannot pass for throughput.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = os.getenv("SIM_BENCH_BODY") or '{"model":"sim-model","prompt":"San Francisco is a","max_tokens":16}'

local bad = 0
response = function(status, headers, body)
  if status ~= 200 then bad = bad + 1 end
end

done = function(summary, latency, requests)
  io.write(string.format("non-2xx or socket errors: %d\n",
    summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
end
