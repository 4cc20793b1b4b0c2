-- wrk script: POST a fixed chat completion; done() prints one JSON line for robust parsing.
-- Set STREAM=1 in the environment for the streaming variant.
local stream = os.getenv("STREAM") == "1"
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench-model","messages":[{"role":"system","content":"You are a helpful assistant."},'
  .. '{"role":"user","content":"Say hello in one short sentence."}],"max_tokens":16'
  .. (stream and ',"stream":true}' or '}')

-- Count non-2xx statuses across threads: each thread has its own Lua state.
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) non2xx = 0 end
function response(status, headers, body)
  if status < 200 or status > 299 then non2xx = non2xx + 1 end
end

function done(summary, latency, requests)
  local bad = 0
  for _, t in ipairs(threads) do bad = bad + (t:get("non2xx") or 0) end
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"duration_us":%d,"rps":%.2f,"p50_ms":%.4f,"p90_ms":%.4f,"p99_ms":%.4f,'
    .. '"mean_ms":%.4f,"non2xx":%d,"err_connect":%d,"err_read":%d,"err_write":%d,"err_status":%d,"err_timeout":%d}\n',
    summary.requests, summary.duration, summary.requests / (summary.duration / 1e6),
    latency:percentile(50) / 1000, latency:percentile(90) / 1000, latency:percentile(99) / 1000,
    latency.mean / 1000, bad, e.connect, e.read, e.write, e.status, e.timeout))
end
