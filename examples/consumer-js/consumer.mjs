// A JavaScript consumer of outbox-relay's messages (nats.js), in any of the
// relay's --message-format values: outbox, cloudevents (binary content mode:
// ce-* headers) and cloudevents-structured (an application/cloudevents+json
// envelope as the data).
//
// It reads messages from a JetStream stream and prints one JSON line per
// message: its subject and stream sequence, Nats-Msg-Id (the row's work_id:
// deduplicate on it), Outbox-Kind, the other Outbox-* headers, the ce-*
// headers or the envelope's attributes, the content type, the message's
// data and the row's payload in base64 (exact bytes), and the payload parsed
// when it is JSON. The payload is the data itself in the first two formats
// and the envelope's data or data_base64 in the third.
//
//   npm install
//   node consumer.mjs --url nats://127.0.0.1:4222 --stream OUTBOX --consumer js-demo --count 10
//
// Each option can come from the environment instead: NATS_URL,
// OUTBOX_STREAM, OUTBOX_CONSUMER, COUNT, TIMEOUT_MS. With a consumer name it
// reads that durable consumer (which must exist; use AckExplicit) and acks
// each message after printing it: a crash in between redelivers it, so the
// real work must be idempotent on Nats-Msg-Id. Without one it reads the
// stream from its start with an ordered consumer and acks nothing. --count
// 0 reads until interrupted; otherwise it exits 0 after that many messages,
// or 1 when none arrives for --timeout-ms.

import { parseArgs } from "node:util";
import { connect } from "@nats-io/transport-node";
import { jetstream } from "@nats-io/jetstream";

const CE_JSON = "application/cloudevents+json";

const { values: opts } = parseArgs({
  options: {
    url: { type: "string", default: process.env.NATS_URL ?? "nats://127.0.0.1:4222" },
    stream: { type: "string", default: process.env.OUTBOX_STREAM ?? "OUTBOX" },
    consumer: { type: "string", default: process.env.OUTBOX_CONSUMER ?? "" },
    count: { type: "string", default: process.env.COUNT ?? "0" },
    "timeout-ms": { type: "string", default: process.env.TIMEOUT_MS ?? "30000" },
  },
});
const count = Number(opts.count);
const timeoutMs = Number(opts["timeout-ms"]);
if (!Number.isInteger(count) || count < 0 || !(timeoutMs > 0)) {
  console.error(`consumer.mjs: --count ${opts.count} / --timeout-ms ${opts["timeout-ms"]}: want an integer >= 0 and a positive number`);
  process.exit(2);
}

// header returns the first value of a header, its name in any case (the
// relay writes Content-Type, a row may carry content-type).
function header(hdrs, name) {
  if (!hdrs) return undefined;
  const want = name.toLowerCase();
  for (const [k, vs] of hdrs) {
    if (k.toLowerCase() === want && vs.length > 0) return vs[0];
  }
  return undefined;
}

// mediaType is a Content-Type without its parameters, lower-case.
function mediaType(ct) {
  return (ct ?? "").split(";")[0].trim().toLowerCase();
}

// A structured event's members, with the raw bytes of each value: JSON.parse
// would rewrite a "data" value (spacing, key order of duplicates, large
// numbers), and the payload's bytes must arrive exactly.
function members(buf) {
  const out = new Map();
  let i = skipSpace(buf, 0);
  if (buf[i] !== 0x7b) throw new Error("the envelope is not a JSON object");
  i = skipSpace(buf, i + 1);
  if (buf[i] === 0x7d) return out;
  for (;;) {
    if (buf[i] !== 0x22) throw new Error(`expected a member name at byte ${i}`);
    const keyEnd = skipValue(buf, i);
    const key = JSON.parse(utf8(buf.subarray(i, keyEnd)));
    i = skipSpace(buf, keyEnd);
    if (buf[i] !== 0x3a) throw new Error(`expected ':' at byte ${i}`);
    const start = skipSpace(buf, i + 1);
    const end = skipValue(buf, start);
    out.set(key, buf.subarray(start, end));
    i = skipSpace(buf, end);
    if (buf[i] === 0x2c) {
      i = skipSpace(buf, i + 1);
      continue;
    }
    if (buf[i] === 0x7d && skipSpace(buf, i + 1) === buf.length) return out;
    throw new Error(`expected ',' or the end of the object at byte ${i}`);
  }
}

function skipSpace(buf, i) {
  while (i < buf.length && (buf[i] === 0x20 || buf[i] === 0x09 || buf[i] === 0x0a || buf[i] === 0x0d)) i++;
  return i;
}

// skipValue returns the end of the JSON value starting at i (bytes: every
// structural character is ASCII, and no byte of a multi-byte UTF-8
// character is).
function skipValue(buf, i) {
  let depth = 0;
  let j = i;
  do {
    const c = buf[j];
    if (c === undefined) throw new Error("the envelope ends inside a value");
    if (c === 0x22) {
      for (j++; buf[j] !== 0x22; j++) {
        if (buf[j] === undefined) throw new Error("the envelope ends inside a string");
        if (buf[j] === 0x5c) j++;
      }
      j++;
    } else if (c === 0x7b || c === 0x5b) {
      depth++;
      j++;
    } else if (c === 0x7d || c === 0x5d) {
      depth--;
      j++;
    } else if (depth > 0 && (c === 0x2c || c === 0x3a || c <= 0x20)) {
      j++;
    } else {
      // A number or a literal: up to the next delimiter.
      while (j < buf.length && !" \t\r\n,:]}".includes(String.fromCharCode(buf[j]))) j++;
    }
  } while (depth > 0);
  if (depth < 0 || j === i) throw new Error(`no JSON value at byte ${i}`);
  return j;
}

const decoder = new TextDecoder("utf-8", { fatal: true });
const utf8 = (b) => decoder.decode(b);

// payloadOf returns the row's payload bytes and, for a structured event,
// its attributes: the same bytes in every format (inbox.Payload in Go).
function payloadOf(data, contentType) {
  if (mediaType(contentType) !== CE_JSON) return { payload: data };
  const m = members(data);
  const event = {};
  for (const [k, v] of m) {
    if (k !== "data" && k !== "data_base64") event[k] = JSON.parse(utf8(v));
  }
  if (event.specversion !== "1.0") throw new Error(`specversion ${JSON.stringify(event.specversion)}: want "1.0"`);
  if (m.has("data") && m.has("data_base64")) throw new Error("both data and data_base64");
  if (m.has("data_base64")) {
    const b64 = JSON.parse(utf8(m.get("data_base64")));
    if (typeof b64 !== "string" || !/^[A-Za-z0-9+/]*={0,2}$/.test(b64) || b64.length % 4 !== 0) {
      throw new Error("data_base64 is not base64");
    }
    return { payload: new Uint8Array(Buffer.from(b64, "base64")), event };
  }
  if (!m.has("data")) return { payload: new Uint8Array(), event };
  const raw = m.get("data");
  JSON.parse(utf8(raw)); // throws unless it is one JSON value
  // Data of any type but JSON is a JSON string holding the text (as the
  // CloudEvents SDKs write it); JSON data is the value itself.
  const dct = mediaType(event.datacontenttype);
  if (raw[0] === 0x22 && dct !== "" && dct !== "application/json" && dct !== "text/json") {
    return { payload: new TextEncoder().encode(JSON.parse(utf8(raw))), event };
  }
  return { payload: raw, event };
}

function describe(m) {
  const h = m.headers;
  const line = { subject: m.subject, seq: m.seq, msgId: header(h, "Nats-Msg-Id") ?? null, kind: header(h, "Outbox-Kind") ?? null };
  const outbox = {};
  const ce = {};
  for (const [k, vs] of h ?? []) {
    if (/^outbox-/i.test(k) && !/^outbox-kind$/i.test(k)) outbox[k] = vs[0];
    if (/^ce-/i.test(k)) ce[k] = vs[0];
  }
  const contentType = header(h, "Content-Type") ?? null;
  let format = "outbox";
  if (mediaType(contentType) === CE_JSON) format = "cloudevents-structured";
  // Binary mode: ce-specversion marks an event (a row's own ce-* header,
  // an extension, can travel in any format).
  else if (header(h, "ce-specversion") !== undefined) format = "cloudevents";
  Object.assign(line, { format, outbox, ce, contentType, data: Buffer.from(m.data).toString("base64") });
  try {
    const { payload, event } = payloadOf(m.data, contentType);
    if (event) line.event = event;
    line.payload = Buffer.from(payload).toString("base64");
    // The content type of the payload: the envelope's or ce-datacontenttype
    // in the CloudEvents formats, else the message's (none: JSON).
    const pct = event ? event.datacontenttype : (ce["ce-datacontenttype"] ?? contentType);
    const mt = mediaType(pct);
    if (mt === "" || mt === "application/json" || mt === "text/json" || mt.endsWith("+json")) {
      try {
        line.json = JSON.parse(utf8(payload));
      } catch {
        // Not JSON after all (bytes under a JSON type): the base64 says what it is.
      }
    }
  } catch (err) {
    line.error = `unreadable ${CE_JSON} envelope: ${err.message}`;
  }
  return line;
}

const nc = await connect({ servers: opts.url, name: "outbox-relay-consumer-js" });
let exitCode = 0;
try {
  const js = jetstream(nc);
  // A named durable consumer, or an ordered one over the whole stream.
  const consumer = opts.consumer ? await js.consumers.get(opts.stream, opts.consumer) : await js.consumers.get(opts.stream);
  let read = 0;
  let lastAt = Date.now();
  while (count === 0 || read < count) {
    const m = await consumer.next({ expires: Math.min(5000, Math.max(1000, timeoutMs)) });
    if (m === null) {
      if (Date.now() - lastAt >= timeoutMs) {
        console.error(`consumer.mjs: ${read} of ${count} messages read; none for ${timeoutMs} ms`);
        exitCode = 1;
        break;
      }
      continue;
    }
    lastAt = Date.now();
    process.stdout.write(JSON.stringify(describe(m)) + "\n");
    if (opts.consumer) await m.ackAck();
    read++;
  }
} catch (err) {
  console.error(`consumer.mjs: ${err.message ?? err}`);
  exitCode = 1;
} finally {
  await nc.drain();
}
process.exit(exitCode);
