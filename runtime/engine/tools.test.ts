/**
 * `tools` and `tool_choice` end to end on the demo model (lavapipe in CI), its file rewritten with Qwen3's real chat
 * template, whose tool format is the tagged one: forced calls are decoded under their function's schema and come back
 * as `tool_calls` whose arguments Ajv accepts, streamed and not; a `tool` message answers a call in the next turn; a
 * model whose template has no tool format refuses tools typed, and the engine answers the next request.
 */
import { readFileSync } from 'node:fs';
import Ajv from 'ajv';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { LLAMA31_STYLE_TEMPLATE, qwen3ChatTemplate, withChatTemplate } from '../../test/chat-templates.ts';
import { withTestGpu } from '../../test/gpu.ts';
import type { ChatCompletionChunk, ChatMessageParam, ChatTool, LongtabEngine } from './api.ts';
import { createNodeEngine } from './node.ts';

const ctx = withTestGpu();
const DEMO = 'public/models/longtab-demo.gguf';
/** The demo model's file with another chat template. */
async function demoWithTemplate(template: string): Promise<Blob> {
  return new Blob([await withChatTemplate(new Uint8Array(readFileSync(DEMO)), template)]);
}

const WEATHER: ChatTool = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather in a city.',
    parameters: {
      type: 'object',
      properties: {
        city: { type: 'string', maxLength: 12 },
        unit: { enum: ['celsius', 'fahrenheit'] },
      },
      required: ['city', 'unit'],
      additionalProperties: false,
    },
  },
};
const TIDE: ChatTool = {
  type: 'function',
  function: {
    name: 'tide_height',
    parameters: {
      type: 'object',
      properties: { port: { type: 'string', maxLength: 12 }, hours: { type: 'integer', minimum: 0, maximum: 48 } },
      required: ['port', 'hours'],
      additionalProperties: false,
    },
  },
};
const ASK: ChatMessageParam[] = [{ role: 'user', content: 'Will it rain in Bath tomorrow?' }];

describe("tools on a model whose template calls them (the demo model with Qwen3's template)", () => {
  let engine: LongtabEngine;
  const ajv = new Ajv({ strict: false });
  const argumentsOf = (name: string, text: string) => {
    const schema = [WEATHER, TIDE].find((t) => t.function.name === name)!.function.parameters!;
    const value = JSON.parse(text);
    expect(ajv.validate(schema, value), text).toBe(true);
    return value;
  };

  beforeAll(async () => {
    engine = createNodeEngine({ gpu: ctx.gpu });
    await engine.load(await demoWithTemplate(qwen3ChatTemplate()), { kv: 'f16', kvBudgetBytes: 8 << 20 });
  }, 120_000);
  afterAll(() => engine?.destroy());

  it('a named function: one call of it, arguments that meet its schema, finish_reason tool_calls', async () => {
    for (const sampling of [{ temperature: 0 }]) {
      const reply = await engine.chat.completions.create({
        messages: ASK,
        tools: [WEATHER, TIDE],
        tool_choice: { type: 'function', function: { name: 'get_weather' } },
        max_tokens: 160,
        ...sampling,
      });
      const choice = reply.choices[0];
      expect(choice.finish_reason).toBe('tool_calls');
      expect(choice.message.content).toBeNull();
      expect(choice.message.tool_calls).toHaveLength(1);
      const call = choice.message.tool_calls![0];
      expect(call).toMatchObject({ type: 'function', function: { name: 'get_weather' } });
      expect(call.id).toMatch(/^call-/);
      argumentsOf('get_weather', call.function.arguments);
    }
  }, 120_000);

  it("'required', streamed: the call arrives as a delta.tool_calls chunk, with no content", async () => {
    const stream = await engine.chat.completions.create({
      messages: ASK,
      tools: [WEATHER, TIDE],
      tool_choice: 'required',
      max_tokens: 160,
      temperature: 0.8,
      seed: 9,
      stream: true,
    });
    const chunks: ChatCompletionChunk[] = [];
    for await (const chunk of stream) chunks.push(chunk);
    const deltas = chunks.flatMap((c) => c.choices[0].delta.tool_calls ?? []);
    expect(deltas).toHaveLength(1);
    expect(deltas[0].index).toBe(0);
    argumentsOf(deltas[0].function.name, deltas[0].function.arguments);
    expect(chunks.map((c) => c.choices[0].delta.content ?? '').join('')).toBe('');
    expect(chunks.at(-1)!.choices[0].finish_reason).toBe('tool_calls');
  }, 120_000);

  it('the next turn carries the call and its result as a tool message; the conversation goes on', async () => {
    const first = await engine.chat.completions.create({
      messages: ASK,
      tools: [WEATHER],
      tool_choice: 'required',
      max_tokens: 160,
      conversation_id: 'weather',
    });
    const call = first.choices[0].message.tool_calls![0];
    const next = await engine.chat.completions.create({
      messages: [
        ...ASK,
        { role: 'assistant', content: null, tool_calls: [call] },
        { role: 'tool', tool_call_id: call.id, content: '{"rain": "likely"}' },
      ],
      tools: [WEATHER],
      max_tokens: 8,
      conversation_id: 'weather',
    });
    // The history up to the call is reused from the first turn's cache.
    expect(next.usage.prompt_tokens_details.cached_tokens).toBeGreaterThan(first.usage.prompt_tokens);
    expect(['stop', 'length', 'tool_calls']).toContain(next.choices[0].finish_reason);
    // tool_choice 'none': a text reply, with the tools still described to the model.
    const text = await engine.chat.completions.create({
      messages: ASK,
      tools: [WEATHER],
      tool_choice: 'none',
      max_tokens: 8,
    });
    expect(text.choices[0].message.tool_calls).toBeUndefined();
    expect(text.choices[0].message.content!.length).toBeGreaterThan(0);
  }, 120_000);

  it('typed errors for what cannot be done; the engine answers the next request', async () => {
    const refuse = (request: object, field: string) =>
      expect(
        engine.chat.completions.create({ messages: ASK, max_tokens: 4, ...request } as never),
      ).rejects.toMatchObject({ code: 'invalid-request', details: { field } });
    await refuse({ tool_choice: 'required' }, 'tool_choice');
    await refuse(
      { tools: [WEATHER], tool_choice: { type: 'function', function: { name: 'nope' } } },
      'tool_choice.function.name',
    );
    await refuse({ tools: [WEATHER, WEATHER] }, 'tools[1].function.name');
    await refuse({ tools: [WEATHER], response_format: { type: 'json_object' } }, 'response_format');
    await refuse({ messages: [{ role: 'tool', content: 'x' }] }, 'messages[0].tool_call_id');
    await refuse(
      {
        tools: [{ type: 'function', function: { name: 'bad', parameters: { type: 'object', properties: 7 } } }],
        tool_choice: 'required',
      },
      'tools',
    );
    const plain = await engine.chat.completions.create({ messages: ASK, max_tokens: 4 });
    expect(plain.choices[0].finish_reason).not.toBe('tool_calls');
  }, 120_000);
});

describe('tools in the JSON-reply format (the demo model with a Llama 3.1-style template)', () => {
  let engine: LongtabEngine;
  const ajv = new Ajv({ strict: false });
  beforeAll(async () => {
    engine = createNodeEngine({ gpu: ctx.gpu });
    await engine.load(await demoWithTemplate(LLAMA31_STYLE_TEMPLATE), { kv: 'f16', kvBudgetBytes: 8 << 20 });
  }, 120_000);
  afterAll(() => engine?.destroy());

  it('a system message with tools (which this template cannot render alone) and a forced call, streamed', async () => {
    const stream = await engine.chat.completions.create({
      messages: [{ role: 'system', content: 'You check the weather.' }, ...ASK],
      tools: [WEATHER, TIDE],
      tool_choice: { type: 'function', function: { name: 'tide_height' } },
      max_tokens: 160,
      stream: true,
    });
    const chunks: ChatCompletionChunk[] = [];
    for await (const chunk of stream) chunks.push(chunk);
    const calls = chunks.flatMap((c) => c.choices[0].delta.tool_calls ?? []);
    expect(chunks.at(-1)!.choices[0].finish_reason).toBe('tool_calls');
    expect(calls.map((c) => c.function.name)).toEqual(['tide_height']);
    expect(ajv.validate(TIDE.function.parameters!, JSON.parse(calls[0].function.arguments))).toBe(true);
  }, 120_000);
});

describe('tools on a model whose template has none (the demo model: ChatML)', () => {
  let engine: LongtabEngine;
  beforeAll(async () => {
    engine = createNodeEngine({ gpu: ctx.gpu });
    await engine.load(DEMO, { kv: 'f16', kvBudgetBytes: 8 << 20 });
  }, 120_000);
  afterAll(() => engine?.destroy());

  it('refuses tools with a typed error that says why, and answers the next request', async () => {
    await expect(
      engine.chat.completions.create({ messages: ASK, tools: [WEATHER], max_tokens: 4 }),
    ).rejects.toMatchObject({ code: 'invalid-request', details: { field: 'tools' }, message: /no tool-call format/ });
    const plain = await engine.chat.completions.create({ messages: ASK, max_tokens: 4 });
    expect(plain.choices[0].message.content!.length).toBeGreaterThan(0);
  }, 120_000);
});
