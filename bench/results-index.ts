/**
 * bench/results/INDEX.md: every committed result file (bench/results, docs/results, tools/train-demo-model/runs) with
 * the date it ran, the commit and machine it ran on, what it shows and the journal section that discusses it. All of
 * it comes from the file's name and contents: a JSON's `date`, `commit` and `adapter` fields, a markdown heading, a
 * log's header line. What a file does not say is "unknown"; nothing is guessed.
 *
 *   npm run results:index        # writes bench/results/INDEX.md
 *
 * bench/results-index.test.ts renders it again in memory and fails when the committed file differs.
 */

import { readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { basename, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { markdownTable } from '../tools/markdown-table.ts';

/** The folders listed, relative to the repository root. */
export const RESULT_DIRS = ['bench/results', 'docs/results', 'tools/train-demo-model/runs'] as const;
export const INDEX_PATH = 'bench/results/INDEX.md';
export const JOURNAL_PATH = 'bench/journal.md';
export const UNKNOWN = 'unknown';

/** What the index says about one file. */
export interface ResultDescription {
  date: string;
  commit: string;
  adapter: string;
  shows: string;
}

/** A section of the lab journal: its anchor, its session number (if any) and the result files it names. */
interface JournalSection {
  title: string;
  anchor: string;
  session: number | null;
  patterns: RegExp[];
}

const MAX_SHOWS = 200;
const DATE_IN_NAME = /^(\d{4}-\d{2}-\d{2})-/;
const ISO_DATE = /\b(\d{4}-\d{2}-\d{2})T\d{2}:\d{2}/;
const COMMIT_WORD = /\bcommits? ([0-9a-f]{7,40}(?:\+[\w-]+)?)\b/;

type Json = Record<string, unknown>;
const isObject = (v: unknown): v is Json => typeof v === 'object' && v !== null && !Array.isArray(v);
const uniq = (values: Iterable<unknown>) => [
  ...new Set([...values].filter((v) => v !== undefined && v !== null && v !== '').map(String)),
];
const list = (values: Iterable<unknown>) => uniq(values).join(', ');

/** A commit as the index shows it: at most 12 hex digits, with the suffix a build added ("+dirty", "+worktree"). */
export function shortCommit(raw: string): string {
  const m = /^([0-9a-f]{7,40})(\+[\w-]+)?/.exec(raw.trim());
  return m ? m[1].slice(0, 12) + (m[2] ?? '') : UNKNOWN;
}

/** The machine a file's name gives: `<date>-nvidia-h200-...`, `...-h200...`, `...-nvidia-h100-...`, `...-lavapipe...`. */
export function machineFromName(name: string): string | null {
  if (/(^|-)nvidia-h200(-|\.|$)/.test(name) || /(^|-)h200(-|\.|$)/.test(name)) return 'nvidia-h200';
  if (/(^|-)nvidia-h100(-|\.|$)/.test(name)) return 'nvidia-h100';
  if (/(^|-)lavapipe(-|\.|$)/.test(name)) return 'lavapipe';
  return null;
}

/** The device of a WebGPU adapter record (`GpuContext.adapter`, or the bench's `{ info }`), or a string as written. */
function adapterOf(value: unknown): string | null {
  if (typeof value === 'string') return value;
  if (!isObject(value)) return null;
  const info = isObject(value.info) ? value.info : value;
  const device = typeof info.device === 'string' ? info.device.replace(/-+$/, '') : '';
  if (device) return device;
  return typeof info.description === 'string' ? info.description : null;
}

function clip(text: string): string {
  const flat = text.replace(/\s+/g, ' ').trim();
  return flat.length > MAX_SHOWS ? `${flat.slice(0, MAX_SHOWS - 1)}…` : flat;
}

/** What the name says, for files whose contents say nothing readable: the words after date and machine. */
function showsFromName(name: string): string {
  const stem = name
    .replace(/\.[^.]+$/, '')
    .replace(DATE_IN_NAME, '')
    .replace(/^(nvidia-h200|lavapipe)-/, '');
  return `(from the name) ${stem.replace(/[-_]/g, ' ')}`;
}

interface BenchRowLike {
  runtime?: unknown;
  model?: unknown;
  weights?: unknown;
  kv?: unknown;
  context?: unknown;
}

/** One line for a set of bench rows: models × weights, each runtime's KV types, contexts. */
function benchRowsSummary(rows: BenchRowLike[]): string {
  const kvOf = (runtime: string) => list(rows.filter((r) => r.runtime === runtime).map((r) => r.kv));
  const parts = [`${list(rows.map((r) => r.model))} × ${list(rows.map((r) => r.weights))}`];
  for (const runtime of uniq(rows.map((r) => r.runtime))) parts.push(`${runtime} KV ${kvOf(runtime)}`);
  parts.push(`contexts ${list(rows.map((r) => r.context))}`);
  return parts.join('; ');
}

/** Rows of the bench's markdown table (`| model | weights | runtime | KV | ctx | ...`). */
function benchTableRows(text: string): BenchRowLike[] {
  const lines = text.split('\n');
  const header = lines.findIndex((l) => /^\|\s*model\s*\|\s*weights\s*\|\s*runtime\s*\|\s*KV\s*\|\s*ctx\s*\|/.test(l));
  if (header < 0) return [];
  const rows: BenchRowLike[] = [];
  for (const line of lines.slice(header + 2)) {
    if (!line.startsWith('|')) break;
    const [model, weights, runtime, kv, context] = line
      .split('|')
      .slice(1, 6)
      .map((c) => c.trim());
    rows.push({ model, weights, runtime, kv, context });
  }
  return rows;
}

function describeJson(name: string, j: unknown): ResultDescription {
  const d: ResultDescription = { date: UNKNOWN, commit: UNKNOWN, adapter: UNKNOWN, shows: showsFromName(name) };
  if (!isObject(j)) return d;
  if (typeof j.date === 'string' && /^\d{4}-\d{2}-\d{2}/.test(j.date)) d.date = j.date.slice(0, 10);
  const prose = [j.what, j.note, j.command].find((v): v is string => typeof v === 'string');
  if (typeof j.commit === 'string') d.commit = shortCommit(j.commit);
  else if (prose && COMMIT_WORD.test(prose)) d.commit = shortCommit(COMMIT_WORD.exec(prose)![1]);
  const runs = isObject(j.runs) ? Object.values(j.runs).filter(isObject) : [];
  d.adapter = adapterOf(j.adapter) ?? adapterOf(j.device) ?? adapterOf(runs[0]?.adapter) ?? UNKNOWN;
  const results = Array.isArray(j.results) ? j.results.filter(isObject) : [];
  const of = (key: string) => list(results.map((r) => r[key]));

  if (j.schema === 'longtab-bench/1' && Array.isArray(j.rows)) {
    const p = isObject(j.protocol) ? j.protocol : {};
    const flags = [j.quick ? 'quick' : '', j.finished === false ? 'unfinished' : ''].filter(Boolean);
    d.shows = `bench: ${benchRowsSummary(j.rows as BenchRowLike[])}; ${p.repeats ?? '?'} repeats${flags.length ? ` (${flags.join(', ')})` : ''}`;
  } else if ('splits' in j && 'minChunk' in j && results.length) {
    const mode = j.prefill === true ? 'prefill' : 'decode';
    const kv = typeof j.kv === 'string' ? j.kv : of('kv') || 'f16';
    d.shows = `attention kernels (bench/attention-kernels.ts), ${mode}, ${kv} pages: ${of('shape')} at ${of('context')} keys`;
  } else if (Array.isArray(j.rows) && j.rows.some((r) => isObject(r) && 'vsText' in r)) {
    const rows = j.rows.filter(isObject);
    const formats = list(rows.map((r) => r.format).filter((f) => f !== 'text'));
    d.shows = `constrained decode (bench/constrained-decode.ts): ${list(rows.map((r) => r.model))} × ${list(rows.map((r) => r.weights))}, KV ${list(rows.map((r) => r.kv))}, context ${list(rows.map((r) => r.context))}: ${formats} against text`;
  } else if ('clipQuantile' in j) {
    d.shows = `KV demotion kernel (bench/demote-kernel.ts), ${j.tokens}-token step, clip quantile ${j.clipQuantile}: ${of('shape')}`;
  } else if (results.some((r) => 'case' in r)) {
    d.shows = `prefill rotation kernel (bench/rotate-kernel.ts), ${j.tokens} tokens: ${of('case')} on ${of('shape')}`;
  } else if (Array.isArray(j.checks) || Array.isArray(j.timings)) {
    const checks = Array.isArray(j.checks) ? j.checks.filter(isObject) : [];
    const failed = checks.filter((c) => c.pass === false).length;
    const timings = Array.isArray(j.timings) ? j.timings.filter(isObject) : [];
    const parts = [];
    if (checks.length) parts.push(`${checks.length} randomized checks, ${failed} failed`);
    if (timings.length) parts.push(`timings at ${timings.length} shapes (${list(timings.map((t) => t.weights))})`);
    d.shows = `int8 matmul (bench/int8-matmul.ts): ${parts.join('; ')}`;
  } else if ('iterations' in j && Array.isArray(j.rows)) {
    d.shows = `arithmetic probe (bench/int8-dot-probe.ts): ${list((j.rows as Json[]).map((r) => r.probe))}`;
  } else if (prose) {
    d.shows = prose;
  } else if ('kvBudgetBytes' in j && Array.isArray(j.rows)) {
    const mib = Number(j.kvBudgetBytes) / 2 ** 20;
    d.shows = `capacity of ${basename(String(j.model))} in a ${mib} MiB KV budget: ${list((j.rows as Json[]).map((r) => r.kv))}`;
  } else if (isObject(j.verdict)) {
    const kvs = Array.isArray(j.results) ? list((j.results as Json[]).map((r) => r.kv)) : '';
    d.shows = `eval of ${basename(String(j.model))} at ${j.ctx} tokens, KV ${kvs}: ${j.verdict.status} (${j.verdict.reason})`;
  } else if (isObject(j.args) && isObject(j.config)) {
    const runNames = isObject(j.runs) ? Object.keys(j.runs).join(', ') : '';
    d.shows = `demo-model training (tools/train-demo-model), shape ${j.args.shape ?? 'default'}: runs ${runNames}; chosen ${j.chosen}`;
  } else if (runs.length) {
    d.shows = `eval runs: ${Object.keys(j.runs as Json).join(', ')}`;
  } else if (Object.values(j).length && Object.values(j).every((v) => isObject(v) && 'variant' in v)) {
    d.shows = `demo-model training probe, variants: ${Object.keys(j).join(', ')}`;
  }
  return d;
}

function describeMarkdown(name: string, text: string): ResultDescription {
  const d: ResultDescription = { date: UNKNOWN, commit: UNKNOWN, adapter: UNKNOWN, shows: showsFromName(name) };
  const first = text.split('\n').find((l) => l.trim()) ?? '';
  const heading = first.startsWith('# ') ? first.slice(2).trim() : '';
  if (ISO_DATE.test(heading)) d.date = ISO_DATE.exec(heading)![1];
  const head = text.slice(0, 4000);
  if (COMMIT_WORD.test(head)) d.commit = shortCommit(COMMIT_WORD.exec(head)![1]);
  const adapter = /^Adapter: \S+ (\S+) \(/m.exec(head);
  if (adapter) d.adapter = adapter[1];
  const rows = benchTableRows(text);
  if (/^longtab bench\b/.test(heading) && rows.length) {
    d.shows = `bench table: ${benchRowsSummary(rows)}`;
  } else if (heading) {
    d.shows = heading.replace(/ \d{4}-\d{2}-\d{2}T[\d:.]+Z/, '').replace(/, commit \S+$/, '');
  } else if (first) {
    d.shows = first;
  }
  return d;
}

function describeText(name: string, text: string): ResultDescription {
  const d: ResultDescription = { date: UNKNOWN, commit: UNKNOWN, adapter: UNKNOWN, shows: showsFromName(name) };
  const lines = text.split('\n').filter((l) => l.trim());
  const head = lines.slice(0, 40).join('\n');
  if (COMMIT_WORD.test(text)) d.commit = shortCommit(COMMIT_WORD.exec(text)![1]);
  const jsonLines = lines
    .filter((l) => l.startsWith('{'))
    .flatMap((l) => {
      try {
        return [JSON.parse(l) as unknown].filter(isObject);
      } catch {
        return [];
      }
    });
  const device = jsonLines.map((o) => adapterOf(o.adapter)).find(Boolean) ?? /^adapter: \S+ (\S+) \(/m.exec(head)?.[1];
  if (device) d.adapter = device;
  const benchLog = lines.filter((l) => /^\[bench [\d:]+\] (longtab|llama\.cpp) \S+ \S+ kv=/.test(l));
  const profile = lines.find((l) => /, context \d+, .*adapter /.test(l));
  const comment = lines[0]?.startsWith('# ') ? lines[0] : undefined;
  const int8Matmul = lines[0]?.startsWith('adapter: ');
  const checks = lines.filter((l) => /^(ok|FAIL)\b/.test(l));
  const rows = jsonLines.filter((o) => 'shape' in o || 'workgroupBytes' in o);
  if (comment) {
    d.shows = comment.slice(2);
  } else if (profile) {
    d.shows = `profile (bench/profile-decode.ts): ${profile.replace(/,? adapter .*$/, '')}`;
  } else if (benchLog.length) {
    const parsed = benchLog.map((l) => {
      const [, runtime, model, weights, kv, context] =
        /^\[bench [\d:]+\] (\S+) (\S+) (\S+) kv=(\S+) ctx=(\d+)/.exec(l) ?? [];
      return { runtime, model, weights, kv, context };
    });
    d.shows = `bench log: ${benchRowsSummary(parsed)}`;
  } else if (int8Matmul) {
    const notes = lines
      .filter((l) => /^\(.*\)$/.test(l) || /checks pass/.test(l))
      .map((l) => l.replace(/^\((.*)\)$/, '$1'));
    d.shows = `int8 matmul (bench/int8-matmul.ts) output: ${notes.join('; ') || lines.length + ' lines'}`;
  } else if (checks.length) {
    const failed = checks.filter((l) => l.startsWith('FAIL')).length;
    d.shows = `kernel checks: ${checks.length - failed} passed, ${failed} failed`;
  } else if (rows.some((o) => 'workgroupBytes' in o)) {
    d.shows = `resident workgroups (bench/occupancy-probe.ts): ${list(rows.map((o) => o.workgroupBytes))} bytes`;
  } else if (rows.length) {
    d.shows = `attention kernels (bench/attention-kernels.ts) output: ${list(rows.map((o) => o.shape))} at ${list(rows.map((o) => o.context))} keys`;
  } else if (lines[0]?.startsWith('flags ')) {
    d.shows = `the adapter's features under each set of Dawn flags (${lines.filter((l) => l.startsWith('flags ')).length} sets)`;
  } else if (lines[0] && !/^[[{]|^NVIDIA: /.test(lines[0])) {
    d.shows = lines[0];
  }
  return d;
}

/** Date, commit, machine and what a file shows, from its name and contents; "unknown" where they say nothing. */
export function describeResult(name: string, text: string): ResultDescription {
  let d: ResultDescription;
  if (name.endsWith('.json')) {
    let parsed: unknown = null;
    try {
      parsed = JSON.parse(text);
    } catch {
      parsed = null;
    }
    d = describeJson(name, parsed);
  } else if (name.endsWith('.md')) {
    d = describeMarkdown(name, text);
  } else {
    d = describeText(name, text);
  }
  if (d.date === UNKNOWN) d.date = DATE_IN_NAME.exec(name)?.[1] ?? UNKNOWN;
  if (d.adapter === UNKNOWN || /^NVIDIA: |^llvmpipe: /.test(d.adapter)) d.adapter = machineFromName(name) ?? d.adapter;
  return { ...d, adapter: d.adapter.replace(/-+$/, ''), shows: clip(d.shows) };
}

/** GitHub's anchor for a heading (github-slugger: lower case, punctuation dropped, spaces to hyphens). */
export function headingAnchor(title: string, seen: Map<string, number>): string {
  const base = title
    .toLowerCase()
    .replace(/[^\p{L}\p{M}\p{N}\p{Pc} -]/gu, '')
    .replace(/ /g, '-');
  const n = seen.get(base) ?? 0;
  seen.set(base, n + 1);
  return n ? `${base}-${n}` : base;
}

/** `a-{b,c}.{md,json}` → every spelling. */
function expandBraces(pattern: string): string[] {
  const m = /\{([^{}]*)\}/.exec(pattern);
  if (!m) return [pattern];
  return m[1]
    .split(',')
    .flatMap((alt) => expandBraces(pattern.slice(0, m.index) + alt + pattern.slice(m.index + m[0].length)));
}

function namePattern(name: string): RegExp {
  const source = name.replace(/[.+?^$()|[\]\\]/g, '\\$&').replace(/\*/g, '.*');
  return new RegExp(`^${source}${name.endsWith('*') ? '' : '(\\.[a-z]+)?'}$`);
}

/**
 * The journal's `##` sections (a `###` belongs to the section above it) and the files each names: whole names
 * (`bench/results/<date>-...`, globs and `{a,b}` included) and the `...-name` shorthand, which stands for
 * `<date>-nvidia-h200-session<N>-name` or `<date>-nvidia-h200-name` with the section's date and session.
 */
export function journalSections(journal: string): JournalSection[] {
  const sections: JournalSection[] = [];
  const seen = new Map<string, number>();
  let current: (JournalSection & { text: string[] }) | null = null;
  const close = () => {
    if (!current) return;
    const text = current.text.join('\n');
    const date = /\b(\d{4}-\d{2}-\d{2})\b/.exec(current.title)?.[1];
    const names: string[] = [];
    for (const m of text.matchAll(/\d{4}-\d{2}-\d{2}-[\w.{},*-]*[\w}*]/g)) names.push(m[0]);
    if (date) {
      for (const m of text.matchAll(/\.\.\.-([\w.{},*-]*[\w}*])/g)) {
        if (current.session !== null) names.push(`${date}-nvidia-h200-session${current.session}-${m[1]}`);
        names.push(`${date}-nvidia-h200-${m[1]}`);
      }
    }
    current.patterns = uniq(names.flatMap(expandBraces)).map(namePattern);
    const { text: _, ...section } = current;
    sections.push(section);
  };
  for (const line of journal.split('\n')) {
    const h2 = /^## (.+)$/.exec(line);
    if (h2) {
      close();
      const title = h2[1].trim();
      const session = /\(session (\d+)\)/.exec(title);
      current = { title, anchor: '', session: session ? Number(session[1]) : null, patterns: [], text: [] };
      current.anchor = headingAnchor(title, seen);
      continue;
    }
    if (line.startsWith('### ')) headingAnchor(line.slice(4).trim(), seen);
    current?.text.push(line);
  }
  close();
  return sections;
}

/** The journal sections that discuss a file: its session's, if its name has one, else those that name it. */
function sectionsFor(name: string, sections: JournalSection[]): JournalSection[] {
  const session = /(?:^|-)session(\d+)/.exec(name);
  if (session) return sections.filter((s) => s.session === Number(session[1]));
  return sections.filter((s) => s.patterns.some((p) => p.test(name)));
}

/** The whole INDEX.md for the tree at `root`. Reads every listed file once. */
export function renderResultsIndex(root: string): string {
  let journal = '';
  try {
    journal = readFileSync(join(root, JOURNAL_PATH), 'utf8');
  } catch {
    journal = '';
  }
  const sections = journalSections(journal);
  const out = [
    '# Results index',
    '',
    'Every result file in `bench/results`, `docs/results` and `tools/train-demo-model/runs`: when it ran, at which commit',
    'and on which machine, what it shows, and the section of the lab journal ([bench/journal.md](../journal.md)) that',
    "discusses it. Generated by `npm run results:index` (`bench/results-index.ts`) from the files themselves (a JSON's",
    '`date`, `commit` and `adapter`, a markdown heading, a log\'s header line, else the file name); "unknown" where they',
    'say nothing. Do not edit: `bench/results-index.test.ts` fails when this file is out of date.',
  ];
  for (const dir of RESULT_DIRS) {
    const names = readdirSync(join(root, dir))
      .filter((n) => `${dir}/${n}` !== INDEX_PATH)
      .sort();
    const link = dir === 'bench/results' ? '' : `../../${dir}/`;
    out.push('', `## ${dir} (${names.length} files)`, '');
    const rows = names.map((name) => {
      const d = describeResult(name, readFileSync(join(root, dir, name), 'utf8'));
      const journalLinks = sectionsFor(name, sections).map((s) => {
        const date = /\d{4}-\d{2}-\d{2}/.exec(s.title)?.[0];
        const label = s.session !== null ? `session ${s.session}` : [s.title.split(/[,(:]/)[0].trim(), date].join(', ');
        return `[${label}](../journal.md#${s.anchor})`;
      });
      return [`[${name}](${link}${name})`, d.date, d.commit, d.adapter, d.shows, journalLinks.join(', ') || '–'];
    });
    out.push(...markdownTable(['file', 'date', 'commit', 'machine', 'what it shows', 'journal'], rows));
  }
  return `${out.join('\n')}\n`;
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
  writeFileSync(join(root, INDEX_PATH), renderResultsIndex(root));
  process.stderr.write(`wrote ${INDEX_PATH}\n`);
}
