/**
 * Response formats through the grammar engine on real vocabularies (the demo model's byte-level BPE, Qwen3's 151K
 * byte-level BPE, stories260K's SentencePiece): random JSON schemas, random walks over the masks each step allows,
 * and an independent validator (Ajv) on what the walk spelled.
 */
import Ajv from 'ajv';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { GgufMetadata } from '../../core/gguf-types.ts';
import { seededRandom } from '../../test/random.ts';
import { randomSchema } from '../../test/random-schema.ts';
import { STORIES260K, sharedPath } from '../../test/shared.ts';
import { bpeTokenizerMetadata } from '../../tools/fixtures/tokenizer-fixtures.ts';
import type { ResponseFormat } from '../engine/api-types.ts';
import { sourceFromPath } from '../gguf/node-source.ts';
import { parseGguf } from '../gguf/parse.ts';
import { GgufTokenizer } from '../tokenizer/tokenizer.ts';
import { ResponseFormatCompiler, type TokenConstraint } from './constraint.ts';

async function ggufTokenizer(path: string): Promise<GgufTokenizer> {
  const source = await sourceFromPath(path);
  try {
    return GgufTokenizer.fromMetadata((await parseGguf(source)).metadata);
  } finally {
    await source.close?.();
  }
}

function allowedIds(mask: Uint32Array, vocab: number): number[] {
  const ids: number[] = [];
  for (let i = 0; i < vocab; i++) if ((mask[i >>> 5] >>> (i & 31)) & 1) ids.push(i);
  return ids;
}

const closers = new WeakMap<GgufTokenizer, Map<number, boolean>>();

/** Whether token `id` starts with a character that ends a JSON value (memoized: Qwen3 allows 151K ids a step). */
function closesValue(tokenizer: GgufTokenizer, id: number): boolean {
  let known = closers.get(tokenizer);
  if (!known) closers.set(tokenizer, (known = new Map()));
  let closes = known.get(id);
  if (closes === undefined) known.set(id, (closes = /^["}\]0-9,]/.test(tokenizer.decode([id]))));
  return closes;
}

/**
 * Walks a constraint to its end: at each step a random allowed id, leaning toward ids that close a value (so the
 * walk ends) and taking a stop id once one is allowed. Returns the ids before the stop id, or null past `limit`.
 */
async function walk(
  constraint: TokenConstraint,
  tokenizer: GgufTokenizer,
  vocab: number,
  random: () => number,
  limit = 400,
): Promise<number[] | null> {
  const ids: number[] = [];
  for (let step = 0; step < limit; step++) {
    const allowed = allowedIds(await constraint.nextMask(), vocab);
    expect(allowed.length).toBeGreaterThan(0);
    const stop = allowed.find((id) => tokenizer.isEndOfGeneration(id));
    if (stop !== undefined && random() < 0.9) {
      constraint.accept(stop);
      expect(constraint.terminated).toBe(true);
      return ids;
    }
    const closing = allowed.filter((id) => closesValue(tokenizer, id));
    const others = allowed.filter((id) => !tokenizer.isEndOfGeneration(id));
    const pool = closing.length > 0 && random() < 0.6 ? closing : others.length > 0 ? others : allowed;
    const id = pool[Math.floor(random() * pool.length)];
    constraint.accept(id);
    if (tokenizer.isEndOfGeneration(id)) {
      expect(constraint.terminated).toBe(true);
      return ids;
    }
    ids.push(id);
  }
  return null;
}

const stories = sharedPath(STORIES260K);
const vocabularies: Array<[string, () => Promise<GgufTokenizer>]> = [
  ['demo model (byte-level BPE, 8K)', () => ggufTokenizer('public/models/longtab-demo.gguf')],
  [
    'Qwen3 (byte-level BPE, 151K)',
    async () =>
      GgufTokenizer.fromMetadata(
        Object.fromEntries(bpeTokenizerMetadata('qwen3').map((e) => [e.key, e.value])) as GgufMetadata,
      ),
  ],
  ...(stories
    ? [['stories260K (SentencePiece, 512)', () => ggufTokenizer(stories)] as [string, () => Promise<GgufTokenizer>]]
    : []),
];

describe.each(vocabularies)('response formats on the %s vocabulary', (_, load) => {
  let tokenizer: GgufTokenizer;
  let compiler: ResponseFormatCompiler;
  let vocab: number;
  const ajv = new Ajv({ strict: false });

  beforeAll(async () => {
    tokenizer = await load();
    vocab = tokenizer.vocabSize;
    compiler = await ResponseFormatCompiler.create(tokenizer.grammarVocabulary(vocab));
  }, 60_000);
  afterAll(() => compiler?.dispose());

  it('random JSON schemas: every walk that ends spells JSON the schema accepts (Ajv)', async () => {
    const random = seededRandom(41);
    let ended = 0;
    for (let trial = 0; trial < 12; trial++) {
      const schema = randomSchema(random);
      const format: ResponseFormat = { type: 'json_schema', json_schema: { name: `s${trial}`, schema } };
      const constraint = (await compiler.constraint(format))!;
      const ids = await walk(constraint, tokenizer, vocab, random);
      constraint.dispose();
      if (ids === null) continue;
      ended++;
      const text = tokenizer.decode(ids);
      const value = JSON.parse(text);
      expect(ajv.validate(schema, value), `${text} against ${JSON.stringify(schema)}`).toBe(true);
    }
    expect(ended).toBeGreaterThanOrEqual(9);
  }, 120_000);

  it('on random prefixes, the mask of a constraint advanced token by token equals a fresh one fed the prefix whole', async () => {
    // The reference is the grammar engine itself, started again: what the engine's mask is after `prefix`, whatever
    // state the constraint carried from step to step. Schemas of the property tests; tool calls on one line.
    const random = seededRandom(13);
    for (let trial = 0; trial < 4; trial++) {
      const format: ResponseFormat = {
        type: 'json_schema',
        json_schema: { name: `p${trial}`, schema: randomSchema(random) },
      };
      const options = trial % 2 === 0 ? {} : { oneLine: true };
      const walker = (await compiler.constraint(format, options))!;
      const prefix: number[] = [];
      for (let step = 0; step < 24 && !walker.terminated; step++) {
        const mask = await walker.nextMask();
        const fresh = (await compiler.constraint(format, options))!;
        for (const id of prefix) fresh.accept(id);
        expect(Array.from(await fresh.nextMask()), `after ${prefix.length} tokens`).toEqual(Array.from(mask));
        fresh.dispose();
        const allowed = allowedIds(mask, vocab).filter((id) => !tokenizer.isEndOfGeneration(id));
        if (allowed.length === 0) break;
        const id = allowed[Math.floor(random() * allowed.length)];
        walker.accept(id);
        prefix.push(id);
      }
      walker.dispose();
    }
  }, 120_000);

  it('json_object spells one JSON object; a grammar spells its language; control tokens are never allowed', async () => {
    const random = seededRandom(7);
    const object = (await compiler.constraint({ type: 'json_object' }))!;
    // The control tokens (other than the stop ids): what grammarVocabulary hands the engine as ''.
    const spelled0 = tokenizer.grammarVocabulary(vocab).tokens;
    const controls = spelled0.flatMap((text, id) => (text === '' && !tokenizer.isEndOfGeneration(id) ? [id] : []));
    expect(controls.length).toBeGreaterThan(0);
    const first = allowedIds(await object.nextMask(), vocab);
    for (const id of controls) expect(first).not.toContain(id);
    const ids = await walk(object, tokenizer, vocab, random);
    object.dispose();
    if (ids !== null) expect(typeof JSON.parse(tokenizer.decode(ids))).toBe('object');

    const grammar = (await compiler.constraint({
      type: 'grammar',
      grammar: 'root ::= "The answer is " ("yes" | "no") "."',
    }))!;
    const spelled = await walk(grammar, tokenizer, vocab, random);
    grammar.dispose();
    expect(spelled).not.toBeNull();
    expect(tokenizer.decode(spelled!)).toMatch(/^The answer is (yes|no)\.$/);
  }, 60_000);

  it('an invalid schema or grammar is an InvalidRequestError that names the field', async () => {
    await expect(compiler.constraint({ type: 'grammar', grammar: 'root ::= ( "a" ' })).rejects.toMatchObject({
      code: 'invalid-request',
      details: { field: 'response_format.grammar' },
    });
    await expect(
      compiler.constraint({ type: 'json_schema', json_schema: { name: 'bad', schema: { type: 'no-such-type' } } }),
    ).rejects.toMatchObject({ code: 'invalid-request', details: { field: 'response_format.json_schema.schema' } });
    // The compiler still works after a refusal.
    expect(await compiler.constraint({ type: 'json_object' })).not.toBeNull();
  });
});
