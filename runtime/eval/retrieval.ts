/**
 * Retrieval tasks (`longtab eval --task passkey|copy|recall`): can the model, at the end of a long context, use what
 * was put at a chosen depth inside filler text? Perplexity barely depends on far history; these tasks depend on
 * nothing else, so they are where a lossy KV cache shows.
 *
 * - **passkey**: a random key sentence at a chosen depth of the filler, asked for at the end; correct when every
 *   digit token of the key is the model's top-1 after the question.
 * - **copy**: a passage of the filler text placed early and repeated at the end, `distance` filler tokens later;
 *   score = top-1 agreement with the repeat (its first token is the cue and not scored). The first copy, scored the
 *   same way, is the no-repeat baseline measured in the same prefill.
 * - **recall** (multi-query associative recall): key→value sentences at a chosen depth, then some of the keys asked
 *   at the end; a query is correct when every digit token of its value is top-1.
 *
 * Every trial is a token sequence of exactly the asked length, built from token ids of the user's filler text and
 * deterministic from (seed, task, length, depth, trial index), so every KV mode sees the same trials. Scoring is
 * teacher-forced: one prefill per trial, the answer tokens are fed, and each is compared with the argmax of the row
 * before it.
 */
import { InvalidRequestError } from '../../core/errors.ts';
import type { WindowScorer } from './perplexity.ts';

export const RETRIEVAL_TASKS = ['passkey', 'copy', 'recall'] as const;

/** The seed `longtab eval --task` draws its trials from unless `--seed` says otherwise. */
export const DEFAULT_RETRIEVAL_SEED = 1;
export type RetrievalTask = (typeof RETRIEVAL_TASKS)[number];

/** The part of GgufTokenizer the generators need. */
export interface TaskTokenizer {
  encode(text: string, options?: { addSpecial?: boolean }): number[];
  decode(ids: number[]): string;
  tokenText(id: number): string;
  readonly bosId?: number;
  readonly addBos: boolean;
}

export interface RetrievalSettings {
  /** passkey: digits of the key. */
  digits: number;
  /** recall: key→value pairs per trial, and how many of them are asked. */
  pairs: number;
  queries: number;
  /** recall: digits of each value. */
  valueDigits: number;
  /** copy: tokens in the repeated passage. */
  copyTokens: number;
}

export const DEFAULT_RETRIEVAL_SETTINGS: RetrievalSettings = {
  digits: 5,
  pairs: 8,
  queries: 4,
  valueDigits: 3,
  copyTokens: 64,
};

/** Sentence templates (exported so a report can quote them). */
export const TEMPLATES = {
  passkeyNeedle: (key: string) => `The pass key is ${key}. Remember it. ${key} is the pass key.`,
  passkeyQuestion: (key: string) => `What is the pass key? The pass key is ${key}.`,
  recallPair: (key: string, value: string) => `The number for ${key} is ${value}.`,
};

/** Recall keys: common one-word nouns (a trial draws `pairs` distinct ones). */
export const RECALL_KEYS = (
  'apple river candle horse garden window letter silver mountain bread cloud door forest lamp mirror ship stone ' +
  'tower wheel book bridge chair coat field fire glass hill island king lake moon nest orange paper queen ring salt ' +
  'table tree village water wind winter cup bell sword flower road'
).split(' ');

export interface RetrievalTrial {
  task: RetrievalTask;
  length: number;
  /** passkey/recall: fraction of the filler before the needle; copy: filler tokens between the two copies. */
  depth: number;
  index: number;
  ids: number[];
  /**
   * Scored items: each a list of positions p whose token ids[p] must be the top-1 prediction of logits row p − 1;
   * an item is correct when all its positions are (passkey: one item; recall: one per query; copy: one per token).
   */
  items: number[][];
  /** copy only: the first copy scored the same way, where nothing earlier repeats it (the baseline). */
  baselineItems?: number[][];
  /** Token span [start, end) holding what the answer is read from: the needle, the pairs, the first copy. */
  needle: { start: number; end: number };
  /** The expected answer as text (key, `key=value` list, or the passage), for reports and debugging. */
  answer: string;
}

/** A deterministic 32-bit generator (mulberry32) seeded from a string. */
export function seededRandom(...parts: Array<string | number>): () => number {
  // FNV-1a over the parts, then mulberry32.
  let h = 0x811c9dc5;
  for (const ch of parts.join(':')) {
    h ^= ch.codePointAt(0)!;
    h = Math.imul(h, 0x01000193);
  }
  let a = h >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) | 0;
    let t = Math.imul(a ^ (a >>> 15), 1 | a);
    t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

function randomInt(random: () => number, below: number): number {
  return Math.floor(random() * below);
}

function randomNumber(random: () => number, digits: number): string {
  let s = String(1 + randomInt(random, 9));
  for (let i = 1; i < digits; i++) s += String(randomInt(random, 10));
  return s;
}

/** Last start index of `needle` inside `haystack`, or −1. */
function lastIndexOfSequence(haystack: number[], needle: number[]): number {
  for (let i = haystack.length - needle.length; i >= 0; i--) {
    let match = true;
    for (let j = 0; j < needle.length && match; j++) match = haystack[i + j] === needle[j];
    if (match) return i;
  }
  return -1;
}

/**
 * Builds the trials of every task from one tokenizer and the filler's token ids. Text pieces (needles, questions) are
 * encoded as words that follow a space, whether the tokenizer adds a dummy-prefix space (SentencePiece) or not (BPE),
 * so pieces join the filler and each other as they would inside running text.
 */
export class RetrievalTaskBuilder {
  readonly settings: RetrievalSettings;
  private readonly prefix: number[];
  private readonly spacePrefixed: boolean;

  constructor(
    private readonly tokenizer: TaskTokenizer,
    private readonly filler: number[],
    settings: Partial<RetrievalSettings> = {},
    readonly seed = 1,
  ) {
    this.settings = { ...DEFAULT_RETRIEVAL_SETTINGS, ...settings };
    const s = this.settings;
    for (const [name, value, min, max] of [
      ['digits', s.digits, 1, 12],
      ['pairs', s.pairs, 1, RECALL_KEYS.length],
      ['queries', s.queries, 1, s.pairs],
      ['valueDigits', s.valueDigits, 1, 12],
      ['copyTokens', s.copyTokens, 2, 1 << 20],
    ] as const) {
      if (!Number.isInteger(value) || value < min || value > max)
        throw new InvalidRequestError(`Retrieval setting ${name} = ${value} must be an integer in ${min}..${max}.`);
    }
    if (s.pairs > 9 * 10 ** (s.valueDigits - 1))
      throw new InvalidRequestError(`Recall: ${s.pairs} distinct values do not fit in ${s.valueDigits} digits.`);
    this.prefix = tokenizer.addBos && tokenizer.bosId !== undefined ? [tokenizer.bosId] : [];
    const first = tokenizer.encode('a', { addSpecial: false })[0];
    this.spacePrefixed = first !== undefined && tokenizer.tokenText(first).startsWith('▁');
  }

  /** Tokens of `text` as words after a space (see the class comment). */
  words(text: string): number[] {
    return this.tokenizer.encode(this.spacePrefixed ? text : ` ${text}`, { addSpecial: false });
  }

  /** The trial `index` of a cell: the same for every KV mode. */
  trial(task: RetrievalTask, length: number, depth: number, index: number): RetrievalTrial {
    if (!Number.isInteger(length) || length < 1)
      throw new InvalidRequestError(`Context length ${length} must be a positive integer.`);
    const random = seededRandom(this.seed, task, length, depth, index);
    switch (task) {
      case 'passkey':
        return this.passkey(length, depth, index, random);
      case 'recall':
        return this.recall(length, depth, index, random);
      case 'copy':
        return this.copy(length, depth, index, random);
      default:
        throw new InvalidRequestError(`Unknown retrieval task '${task}': use ${RETRIEVAL_TASKS.join(', ')}.`);
    }
  }

  private checkDepth(depth: number): void {
    if (!(depth >= 0 && depth <= 1))
      throw new InvalidRequestError(`Needle depth ${depth} must be a fraction in 0..1 (0 = first, 1 = last).`);
  }

  /** `size` consecutive filler ids from a random offset, avoiding the corpus span [avoid.start, avoid.end). */
  private fillerWindow(random: () => number, size: number, avoid?: { start: number; end: number }): number {
    const n = this.filler.length;
    if (size > n) {
      throw new InvalidRequestError(
        `The filler text has ${n} tokens; this trial needs ${size}${avoid ? ` plus ${avoid.end - avoid.start} more` : ''}: pass a longer --text.`,
      );
    }
    for (let attempt = 0; attempt < 1000; attempt++) {
      const start = randomInt(random, n - size + 1);
      if (!avoid || start + size <= avoid.start || start >= avoid.end) return start;
    }
    throw new InvalidRequestError(`The filler text (${n} tokens) is too short for two separate windows: pass more.`);
  }

  /** Positions in `ids[offset..]` of the tokens of `answer` inside `segment` that carry text (not bare spaces). */
  private answerPositions(segment: number[], answer: string, offset: number): number[] {
    const answerIds = this.words(answer);
    const at = lastIndexOfSequence(segment, answerIds);
    if (at < 0) {
      throw new InvalidRequestError(
        `The tokenizer does not keep '${answer}' as the same tokens inside a sentence; the retrieval templates need a tokenizer that does.`,
      );
    }
    const positions: number[] = [];
    answerIds.forEach((id, i) => {
      if (/\S/.test(this.tokenizer.decode([id]))) positions.push(offset + at + i);
    });
    if (positions.length === 0) throw new InvalidRequestError(`The answer '${answer}' has no scorable tokens.`);
    return positions;
  }

  /** [prefix, filler[0..a], needle, filler[a..], tail]: the needle after a = round(depth × filler) filler tokens. */
  private assemble(
    length: number,
    depth: number,
    random: () => number,
    needle: number[],
    tail: number[],
    what: string,
  ) {
    const fill = length - this.prefix.length - needle.length - tail.length;
    if (fill < 0) {
      throw new InvalidRequestError(
        `Context length ${length} is shorter than the ${what} itself (${length - fill} tokens): use a longer --lengths.`,
      );
    }
    const start = this.fillerWindow(random, fill);
    const a = Math.round(depth * fill);
    const ids = [
      ...this.prefix,
      ...this.filler.slice(start, start + a),
      ...needle,
      ...this.filler.slice(start + a, start + fill),
      ...tail,
    ];
    const needleStart = this.prefix.length + a;
    return { ids, needle: { start: needleStart, end: needleStart + needle.length }, tailStart: length - tail.length };
  }

  private passkey(length: number, depth: number, index: number, random: () => number): RetrievalTrial {
    this.checkDepth(depth);
    const key = randomNumber(random, this.settings.digits);
    const needle = this.words(TEMPLATES.passkeyNeedle(key));
    const question = this.words(TEMPLATES.passkeyQuestion(key));
    const built = this.assemble(length, depth, random, needle, question, 'pass key needle and question');
    const items = [this.answerPositions(question, key, built.tailStart)];
    return { task: 'passkey', length, depth, index, ids: built.ids, items, needle: built.needle, answer: key };
  }

  private recall(length: number, depth: number, index: number, random: () => number): RetrievalTrial {
    this.checkDepth(depth);
    const { pairs, queries, valueDigits } = this.settings;
    const keys = [...RECALL_KEYS];
    const values = new Set<string>();
    const chosen: Array<{ key: string; value: string }> = [];
    for (let i = 0; i < pairs; i++) {
      const key = keys.splice(randomInt(random, keys.length), 1)[0];
      let value = randomNumber(random, valueDigits);
      while (values.has(value)) value = randomNumber(random, valueDigits);
      values.add(value);
      chosen.push({ key, value });
    }
    const block = chosen.flatMap(({ key, value }) => this.words(TEMPLATES.recallPair(key, value)));
    const order = chosen.map((_, i) => i);
    for (let i = order.length - 1; i > 0; i--) {
      const j = randomInt(random, i + 1);
      [order[i], order[j]] = [order[j], order[i]];
    }
    const asked = order.slice(0, queries).map((i) => chosen[i]);
    const sentences = asked.map(({ key, value }) => this.words(TEMPLATES.recallPair(key, value)));
    const tail = sentences.flat();
    const built = this.assemble(length, depth, random, block, tail, 'key-value block and queries');
    let offset = built.tailStart;
    const items = sentences.map((sentence, q) => {
      const positions = this.answerPositions(sentence, asked[q].value, offset);
      offset += sentence.length;
      return positions;
    });
    const answer = asked.map(({ key, value }) => `${key}=${value}`).join(', ');
    return { task: 'recall', length, depth, index, ids: built.ids, items, needle: built.needle, answer };
  }

  private copy(length: number, distance: number, index: number, random: () => number): RetrievalTrial {
    const p = this.settings.copyTokens;
    if (!Number.isInteger(distance) || distance < 0)
      throw new InvalidRequestError(`Copy distance ${distance} must be a whole number of tokens >= 0.`);
    const lead = length - this.prefix.length - 2 * p - distance;
    if (lead < 0) {
      throw new InvalidRequestError(
        `Context length ${length} cannot hold two ${p}-token copies ${distance} tokens apart (needs ${length - lead}).`,
      );
    }
    const fillStart = this.fillerWindow(random, lead + distance);
    // The passage comes from elsewhere in the text, never overlapping the filler window.
    const passageStart = this.fillerWindow(random, p, { start: fillStart, end: fillStart + lead + distance });
    const passage = this.filler.slice(passageStart, passageStart + p);
    const ids = [
      ...this.prefix,
      ...this.filler.slice(fillStart, fillStart + lead),
      ...passage,
      ...this.filler.slice(fillStart + lead, fillStart + lead + distance),
      ...passage,
    ];
    const first = this.prefix.length + lead;
    const second = first + p + distance;
    const tokens = (start: number) => Array.from({ length: p - 1 }, (_, i) => [start + 1 + i]);
    return {
      task: 'copy',
      length,
      depth: distance,
      index,
      ids,
      items: tokens(second),
      baselineItems: tokens(first),
      needle: { start: first, end: first + p },
      answer: this.tokenizer.decode(passage),
    };
  }
}

/** Chance level where it is known without measuring: passkey 10^−digits; recall 1/pairs; copy: measured. */
export function analyticChance(
  task: RetrievalTask,
  settings: RetrievalSettings,
): { chance: number | null; note: string } {
  switch (task) {
    case 'passkey':
      return { chance: 10 ** -settings.digits, note: `a uniform guess of ${settings.digits} digits` };
    case 'recall':
      return { chance: 1 / settings.pairs, note: `naming one of the ${settings.pairs} listed values at random` };
    case 'copy':
      return { chance: null, note: 'measured: top-1 on the first copy, where nothing earlier repeats it' };
  }
}

const Z95 = 1.959963984540054;

/**
 * Wilson score interval for `successes` out of `n` (95% by default). `successes` may be fractional (a mean score in
 * [0, 1] times n): a [0, 1] variable's variance is at most p(1 − p), so the interval stays conservative.
 */
export function wilsonInterval(successes: number, n: number, z = Z95): { low: number; high: number } {
  if (n <= 0) return { low: 0, high: 1 };
  const p = successes / n;
  const z2 = z * z;
  const denominator = 1 + z2 / n;
  const center = (p + z2 / (2 * n)) / denominator;
  const half = (z / denominator) * Math.sqrt((p * (1 - p)) / n + z2 / (4 * n * n));
  return { low: Math.max(0, center - half), high: Math.min(1, center + half) };
}

export interface TrialScore {
  items: number;
  itemsCorrect: number;
  tokens: number;
  tokensCorrect: number;
  /** copy: the same on the first copy. */
  baselineItems?: number;
  baselineCorrect?: number;
}

function argmaxRow(logits: Float32Array, offset: number, vocab: number): number {
  let best = 0;
  for (let i = 1; i < vocab; i++) if (logits[offset + i] > logits[offset + best]) best = i;
  return best;
}

function scoreItems(trial: RetrievalTrial, items: number[][], logits: Float32Array, vocab: number) {
  let correct = 0;
  let tokens = 0;
  let tokensCorrect = 0;
  for (const item of items) {
    let all = true;
    for (const p of item) {
      const hit = argmaxRow(logits, (p - 1) * vocab, vocab) === trial.ids[p];
      tokens++;
      tokensCorrect += hit ? 1 : 0;
      all &&= hit;
    }
    correct += all ? 1 : 0;
  }
  return { items: items.length, correct, tokens, tokensCorrect };
}

/** Scores one trial from its teacher-forced logits ([ids.length × vocab], row t follows ids[0..t]). */
export function scoreTrial(trial: RetrievalTrial, logits: Float32Array, vocab: number): TrialScore {
  if (logits.length < trial.ids.length * vocab)
    throw new InvalidRequestError(`Expected ${trial.ids.length} rows of ${vocab} logits, got ${logits.length}.`);
  const main = scoreItems(trial, trial.items, logits, vocab);
  const score: TrialScore = {
    items: main.items,
    itemsCorrect: main.correct,
    tokens: main.tokens,
    tokensCorrect: main.tokensCorrect,
  };
  if (trial.baselineItems) {
    const base = scoreItems(trial, trial.baselineItems, logits, vocab);
    score.baselineItems = base.items;
    score.baselineCorrect = base.correct;
  }
  return score;
}

export interface CellSummary {
  trials: number;
  items: number;
  itemsCorrect: number;
  /** Mean over trials of the fraction of items correct (passkey: the fraction of trials). */
  accuracy: number;
  /** Wilson 95% interval with n = trials (conservative for fractional per-trial scores). */
  ci: { low: number; high: number };
  tokens: number;
  tokensCorrect: number;
  tokenAccuracy: number;
  baseline?: { accuracy: number; ci: { low: number; high: number } };
}

export function summarizeCell(scores: TrialScore[]): CellSummary {
  const n = scores.length;
  const sum = (f: (s: TrialScore) => number) => scores.reduce((acc, s) => acc + f(s), 0);
  const meanScore = n > 0 ? sum((s) => s.itemsCorrect / s.items) / n : Number.NaN;
  const tokens = sum((s) => s.tokens);
  const summary: CellSummary = {
    trials: n,
    items: sum((s) => s.items),
    itemsCorrect: sum((s) => s.itemsCorrect),
    accuracy: meanScore,
    ci: wilsonInterval(n > 0 ? meanScore * n : 0, n),
    tokens,
    tokensCorrect: sum((s) => s.tokensCorrect),
    tokenAccuracy: tokens > 0 ? sum((s) => s.tokensCorrect) / tokens : Number.NaN,
  };
  if (n > 0 && scores.every((s) => s.baselineItems)) {
    const base = sum((s) => s.baselineCorrect! / s.baselineItems!) / n;
    summary.baseline = { accuracy: base, ci: wilsonInterval(base * n, n) };
  }
  return summary;
}

/** Runs `trials` trials of one cell through `scorer` (one teacher-forced prefill each) and summarizes them. */
export async function runCell(
  scorer: WindowScorer,
  builder: RetrievalTaskBuilder,
  vocab: number,
  cell: { task: RetrievalTask; length: number; depth: number; trials: number },
  onTrial?: (done: number, score: TrialScore) => void,
): Promise<{ summary: CellSummary; scores: TrialScore[] }> {
  const scores: TrialScore[] = [];
  for (let i = 0; i < cell.trials; i++) {
    const trial = builder.trial(cell.task, cell.length, cell.depth, i);
    const scored = new Set<number>(); // logits row p - 1 predicts position p
    for (const item of [...trial.items, ...(trial.baselineItems ?? [])]) for (const p of item) scored.add(p - 1);
    const logits = await scorer.teacherForcedLogits(trial.ids, (row) => scored.has(row));
    const score = scoreTrial(trial, logits, vocab);
    scores.push(score);
    onTrial?.(i + 1, score);
  }
  return { summary: summarizeCell(scores), scores };
}

export interface RetrievalRow extends CellSummary {
  kv: string;
  length: number;
  depth: number;
  seconds: number;
}

/**
 * Whether the table can judge a KV cache: only cells where the f16 cache beats chance (its 95% interval above the
 * chance level, or above the first-copy baseline for copy) can show a cache losing the answer.
 */
export function judgeRetrieval(
  rows: RetrievalRow[],
  chance: number | null,
): { status: 'no-f16' | 'at-chance' | 'informative'; reason: string; informativeCells: number; cells: number } {
  const f16 = rows.filter((r) => r.kv === 'f16');
  if (f16.length === 0) {
    return {
      status: 'no-f16',
      reason: 'add f16 (--compare) to see which cells the model can do at all',
      informativeCells: 0,
      cells: 0,
    };
  }
  const above = f16.filter((r) => r.ci.low > (chance ?? r.baseline?.accuracy ?? 1));
  if (above.length === 0) {
    return {
      status: 'at-chance',
      reason: `with an f16 cache the model is not above chance in any of the ${f16.length} cells: it does not do this task, so the table cannot judge a KV cache`,
      informativeCells: 0,
      cells: f16.length,
    };
  }
  return {
    status: 'informative',
    reason: `with an f16 cache the model is above chance in ${above.length} of ${f16.length} cells; compare the KV modes there`,
    informativeCells: above.length,
    cells: f16.length,
  };
}

const pct = (x: number) => x.toFixed(3);

/** Markdown: one row per (length, depth), one column per KV mode, cells `accuracy [low, high]`. */
export function formatRetrievalTable(
  task: RetrievalTask,
  rows: RetrievalRow[],
  modes: string[],
  chance: number | null,
): string {
  const depthHeader = task === 'copy' ? 'distance (tokens)' : 'depth';
  const chanceHeader = task === 'copy' ? `first copy (${modes[0]})` : 'chance';
  let out = `| length | ${depthHeader} | ${modes.join(' | ')} | ${chanceHeader} |\n`;
  out += `|---|---|${modes.map(() => '---|').join('')}---|\n`;
  const cells = [...new Map(rows.map((r) => [`${r.length}:${r.depth}`, r])).values()];
  for (const cell of cells) {
    const inCell = rows.filter((r) => r.length === cell.length && r.depth === cell.depth);
    const values = modes.map((kv) => {
      const r = inCell.find((x) => x.kv === kv);
      return r ? `${pct(r.accuracy)} [${pct(r.ci.low)}, ${pct(r.ci.high)}]` : '';
    });
    const first = inCell.find((x) => x.kv === modes[0]);
    const reference = chance !== null ? chance.toPrecision(2) : first?.baseline ? pct(first.baseline.accuracy) : '';
    const depth = task === 'copy' ? String(cell.depth) : cell.depth.toFixed(2);
    out += `| ${cell.length} | ${depth} | ${values.join(' | ')} | ${reference} |\n`;
  }
  return out;
}
