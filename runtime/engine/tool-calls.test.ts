/**
 * Tool calls read out of replies: the format a template writes (Qwen3's real template, ChatML, a Llama 3.1-style JSON
 * template), the reader on replies of both formats, and the same reading however the reply is cut into stream pieces.
 */
import Ajv from 'ajv';
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { LLAMA31_STYLE_TEMPLATE, qwen3ChatTemplate } from '../../test/chat-templates.ts';
import { FALLBACK_CHAT_TEMPLATE, renderChatTemplate } from '../tokenizer/chat-template.ts';
import type { ChatTool } from './api-types.ts';
import { forcedCallFrame, forcedCallSchema, ToolCallReader, type ToolFormat, toolFormatOf } from './tool-calls.ts';
import { validateChatRequest } from './validate.ts';

const QWEN3_TEMPLATE = qwen3ChatTemplate();

const TOOLS: ChatTool[] = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      parameters: { type: 'object', properties: { city: { type: 'string' } }, required: ['city'] },
    },
  },
  { type: 'function', function: { name: 'get_time' } },
];

function reader(format: ToolFormat): ToolCallReader {
  let n = 0;
  return new ToolCallReader(format, TOOLS, () => `call_${n++}`);
}

/** The reply read in the given pieces: its content, and its calls. */
function read(format: ToolFormat, pieces: string[]) {
  const r = reader(format);
  let content = '';
  const calls = [];
  for (const reading of [...pieces.map((p) => r.push(p)), r.flush()]) {
    content += reading.content;
    calls.push(...reading.calls);
  }
  return { content, calls };
}

const tagged = toolFormatOf(QWEN3_TEMPLATE)!;
const json = toolFormatOf(LLAMA31_STYLE_TEMPLATE)!;

describe('tool formats of chat templates', () => {
  it("reads Qwen3's template as tagged, a Llama 3.1-style one as a JSON reply, ChatML as none", () => {
    expect(tagged.kind).toBe('tagged');
    expect(json.kind).toBe('json');
    expect(json.argumentsKey).toBe('parameters');
    expect(toolFormatOf(FALLBACK_CHAT_TEMPLATE)).toBeNull();
  });

  it('frames a forced call as the template writes one, under a schema of the function', () => {
    expect(forcedCallFrame(tagged)).toEqual({ prefix: '<tool_call>\n', suffix: '\n</tool_call>' });
    expect(forcedCallFrame(json)).toEqual({ prefix: '', suffix: '' });
    const named = forcedCallSchema(json, TOOLS, { type: 'function', function: { name: 'get_weather' } });
    expect(named).toEqual({
      type: 'object',
      properties: { name: { const: 'get_weather' }, parameters: TOOLS[0].function.parameters },
      required: ['name', 'parameters'],
      additionalProperties: false,
    });
    const required = forcedCallSchema(tagged, TOOLS, 'required') as { anyOf: Array<{ properties: object }> };
    expect(required.anyOf.map((s) => s.properties)).toEqual([
      { name: { const: 'get_weather' }, arguments: TOOLS[0].function.parameters },
      { name: { const: 'get_time' }, arguments: { type: 'object' } },
    ]);
  });
});

describe('forced calls of functions whose parameters use definitions', () => {
  it("moves each function's definitions to the root, where its references point, and Ajv resolves them", () => {
    const tree = (name: string, leaf: string): ChatTool => ({
      type: 'function',
      function: {
        name,
        parameters: {
          type: 'object',
          properties: { node: { $ref: '#/$defs/Node' } },
          required: ['node'],
          $defs: {
            Node: {
              type: 'object',
              properties: {
                label: { $ref: '#/definitions/Leaf' },
                children: { type: 'array', items: { $ref: '#/$defs/Node' } },
              },
              required: ['label'],
            },
          },
          definitions: { Leaf: { type: 'string', enum: [leaf] } },
        },
      },
    });
    const tools = [tree('plant', 'leaf'), tree('family', 'child')];
    const accepts = new Ajv({ strict: false }).compile(forcedCallSchema(tagged, tools, 'required'));
    const call = (name: string, label: string) => ({
      name,
      arguments: { node: { label, children: [{ label, children: [] }] } },
    });
    expect(accepts(call('plant', 'leaf'))).toBe(true);
    expect(accepts(call('family', 'child'))).toBe(true);
    // Each function keeps its own definitions: a label of the other's is refused, and so are non-object arguments.
    expect(accepts(call('plant', 'child'))).toBe(false);
    expect(accepts({ name: 'plant', arguments: 'x' })).toBe(false);
  });
});

describe('a conversation with tools, as the templates render it', () => {
  // What the engine hands the template: the validated request's messages (call arguments parsed) and its tools.
  const request = validateChatRequest({
    messages: [
      { role: 'user', content: 'Weather in Oslo?' },
      {
        role: 'assistant',
        content: null,
        tool_calls: [
          { id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo"}' } },
        ],
      },
      { role: 'tool', tool_call_id: 'call_1', content: '{"sky":"clear"}' },
    ],
    tools: TOOLS,
  });
  const render = (template: string) =>
    renderChatTemplate(template, { messages: request.messages, tools: request.tools, add_generation_prompt: true });

  it("Qwen3's: the tools in its system turn, the call in its tags, the result as a tool response", () => {
    const text = render(QWEN3_TEMPLATE);
    expect(text).toContain('<tools>\n{"type": "function", "function": {"name": "get_weather"');
    // Written on one line with Python's separators, as a forced call is decoded (ToolPlan): a call the model made
    // is the prefix of the next turn's text, and its tokens are reused from the cache.
    expect(text).toContain('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>');
    expect(text).toContain('<tool_response>\n{"sky":"clear"}\n</tool_response>');
    // The reader takes back what the template writes.
    const call = text.slice(text.lastIndexOf('<tool_call>'), text.lastIndexOf('</tool_call>') + '</tool_call>'.length);
    expect(read(tagged, [call]).calls.map((c) => c.function)).toEqual([
      { name: 'get_weather', arguments: '{"city":"Oslo"}' },
    ]);
  });

  it('a Llama 3.1-style one: the call as a JSON reply with its parameters', () => {
    expect(render(LLAMA31_STYLE_TEMPLATE)).toContain('{"name": "get_weather", "parameters": {"city": "Oslo"}}');
  });
});

describe('ToolCallReader', () => {
  it('tagged: text around calls is content, each block a call of one of the tools', () => {
    const reply =
      'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' +
      '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>';
    expect(read(tagged, [reply])).toEqual({
      content: 'Let me look.',
      calls: [
        { id: 'call_0', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Paris"}' } },
        { id: 'call_1', type: 'function', function: { name: 'get_time', arguments: '{}' } },
      ],
    });
  });

  it('tagged: an opening tag mentioned before the call stays text, and the call after it is read', () => {
    const reply = 'I will use <tool_call> for this.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>';
    expect(read(tagged, [reply])).toEqual({
      content: 'I will use <tool_call> for this.',
      calls: [{ id: 'call_0', type: 'function', function: { name: 'get_time', arguments: '{}' } }],
    });
  });

  it('tagged: a block that is not a call of the tools, and a call cut off, stay text', () => {
    const unknown = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>';
    expect(read(tagged, [unknown])).toEqual({ content: unknown, calls: [] });
    const broken = 'A <tool_call>{"name": "get_time", "arguments": {</tool_call> B';
    expect(read(tagged, [broken])).toEqual({ content: broken, calls: [] });
    const cut = 'Sure. <tool_call>\n{"name": "get_time", "argu';
    expect(read(tagged, [cut])).toEqual({ content: cut, calls: [] });
    expect(read(tagged, ['No tools needed: 1 < 2.'])).toEqual({ content: 'No tools needed: 1 < 2.', calls: [] });
  });

  it('json: a reply that is a call object (or an array of them) is calls; other replies are text', () => {
    expect(read(json, ['{"name": "get_weather", "parameters": {"city": "Oslo"}}']).calls).toEqual([
      { id: 'call_0', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo"}' } },
    ]);
    const two = ' [{"name": "get_time", "parameters": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]';
    expect(read(json, [two]).calls.map((c) => c.function.name)).toEqual(['get_time', 'get_weather']);
    expect(read(json, ['It is sunny.'])).toEqual({ content: 'It is sunny.', calls: [] });
    const notACall = '{"weather": "sunny"}';
    expect(read(json, [notACall])).toEqual({ content: notACall, calls: [] });
  });

  it('reads a reply the same however it is cut into stream pieces', () => {
    const replies = [
      'Checking.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>\n\n',
      '  Hello <tool_ <tool_call>x</tool_call> <tool_call>{"name": "get_time", "arguments": {}}</tool_call> end ',
      '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>',
    ];
    for (const [format, reply] of [
      ...replies.map((r): [ToolFormat, string] => [tagged, r]),
      [json, '\n{"name": "get_weather", "parameters": {"city": "Kyiv"}}'],
      [json, 'Plain text with { braces } and\nlines.'],
    ] as Array<[ToolFormat, string]>) {
      const whole = read(format, [reply]);
      fc.assert(
        fc.property(fc.uniqueArray(fc.integer({ min: 1, max: reply.length - 1 }), { maxLength: 12 }), (cuts) => {
          const at = [0, ...cuts.sort((a, b) => a - b), reply.length];
          const pieces = at.slice(1).map((end, i) => reply.slice(at[i], end));
          expect(read(format, pieces)).toEqual(whole);
        }),
        { seed: 41, numRuns: 200 },
      );
    }
  });
});
