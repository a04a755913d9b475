// The Prometheus text format (0.0.4, what /metrics serves) and the arithmetic the dashboard
// does on it: sums by label, rates between two scrapes, quantiles from histogram buckets.

const SAMPLE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
const UNESCAPE = { "\\\\": "\\", '\\"': '"', "\\n": "\n" };

function number(text) {
  if (text === "+Inf") return Infinity;
  if (text === "-Inf") return -Infinity;
  return Number(text); // "NaN" is NaN too
}

/** Prometheus text -> Map(sample name -> [{labels, value}]). Comments and blank lines skipped. */
export function parseMetrics(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const match = SAMPLE.exec(line);
    if (!match) continue;
    const labels = {};
    for (const [, name, value] of (match[2] || "").matchAll(LABEL)) {
      labels[name] = value.replace(/\\[\\"n]/g, (e) => UNESCAPE[e]);
    }
    if (!samples.has(match[1])) samples.set(match[1], []);
    samples.get(match[1]).push({ labels, value: number(match[3]) });
  }
  return samples;
}

/** The key of a model version's series: "model@version". */
export function versionKey(labels) {
  return `${labels.model_name}@${labels.version}`;
}

/** Map(key(labels) -> sum of the values) of one sample name, other labels summed over. */
export function sumBy(samples, name, key = versionKey) {
  const sums = new Map();
  for (const { labels, value } of samples.get(name) || []) {
    const k = key(labels);
    sums.set(k, (sums.get(k) || 0) + value);
  }
  return sums;
}

/** Map(key -> [{le, count}] ascending, cumulative) of histogram `base` (its `_bucket` series),
 *  other labels summed over. */
export function histograms(samples, base, key = versionKey) {
  const byKey = new Map();
  for (const { labels, value } of samples.get(`${base}_bucket`) || []) {
    const k = key(labels);
    if (!byKey.has(k)) byKey.set(k, new Map());
    const buckets = byKey.get(k);
    const le = number(labels.le);
    buckets.set(le, (buckets.get(le) || 0) + value);
  }
  const out = new Map();
  for (const [k, buckets] of byKey) {
    out.set(
      k,
      [...buckets].map(([le, count]) => ({ le, count })).sort((a, b) => a.le - b.le),
    );
  }
  return out;
}

/** The observations between two scrapes of one histogram (bucket by bucket). A counter that
 *  went down (the version restarted, or is new) counts from zero. */
export function bucketDelta(now, before) {
  if (!before || before.length !== now.length) return now;
  const delta = now.map((b, i) => ({ le: b.le, count: b.count - before[i].count }));
  return delta.some((b) => b.count < 0) ? now : delta;
}

/** Merge the buckets of several histograms with the same bounds (e.g. every version's). */
export function mergeBuckets(list) {
  const merged = new Map();
  for (const buckets of list) {
    for (const { le, count } of buckets) merged.set(le, (merged.get(le) || 0) + count);
  }
  return [...merged].map(([le, count]) => ({ le, count })).sort((a, b) => a.le - b.le);
}

/** The q-quantile of cumulative buckets, as Prometheus' histogram_quantile estimates it: linear
 *  within the bucket the rank falls in; the highest finite bound when it falls in +Inf.
 *  E.g. buckets (0.1: 5, 0.5: 10, +Inf: 10), q 0.75: rank 7.5 in (0.1, 0.5] -> 0.3.
 *  NaN without observations. */
export function quantile(q, buckets) {
  if (!buckets || buckets.length === 0) return NaN;
  const total = buckets[buckets.length - 1].count;
  if (!(total > 0)) return NaN;
  const rank = q * total;
  let lower = 0;
  let below = 0;
  for (const { le, count } of buckets) {
    if (count >= rank) {
      if (le === Infinity) return lower;
      if (count === below) return le;
      return lower + ((le - lower) * (rank - below)) / (count - below);
    }
    lower = le;
    below = count;
  }
  return lower;
}

/** Per-second rate of a counter between two scrapes `seconds` apart; a reset counts from 0. */
export function rate(now, before, seconds) {
  if (now === undefined || !(seconds > 0)) return NaN;
  const base = before === undefined || before > now ? 0 : before;
  return (now - base) / seconds;
}
