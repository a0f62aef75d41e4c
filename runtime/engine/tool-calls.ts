/**
 * Tool calling through the model's own chat template: which format the template writes calls in, how a reply is
 * read back into OpenAI's `tool_calls` (streamed or whole, by one reader), and what a forced call is decoded under.
 * Two formats cover the supported families:
 * - 'tagged' (Qwen2.5, Qwen3, SmolLM3 and other Hermes-style templates): each call is
 *   `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, text may stand around the calls;
 * - 'json' (Llama 3.1 to 3.3): the whole reply is one `{"name": ..., "parameters": {...}}` object.
 * The template's own text decides; a template that writes neither cannot call tools.
 */
import type { ChatTool, ChatToolCall, ChatToolChoice } from './api-types.ts';

export interface ToolFormat {
  kind: 'tagged' | 'json';
  /** The key a call's arguments go under. */
  argumentsKey: 'arguments' | 'parameters';
  /** Text that opens and closes one call ('tagged'; empty for 'json', whose call is the reply). */
  open: string;
  close: string;
}

const TAGGED: ToolFormat = { kind: 'tagged', argumentsKey: 'arguments', open: '<tool_call>', close: '</tool_call>' };
const JSON_REPLY: ToolFormat = { kind: 'json', argumentsKey: 'parameters', open: '', close: '' };

/**
 * The tool format a chat template writes, from its text: the `<tool_call>` tag, or (a template that renders
 * `tools` and asks for `"parameters"`) Llama 3.1's JSON reply; null for a template with neither.
 */
export function toolFormatOf(template: string): ToolFormat | null {
  if (template.includes('<tool_call>')) return TAGGED;
  if (/\btools\b/.test(template) && template.includes('"parameters"')) return JSON_REPLY;
  return null;
}

/** The prompt's end and the reply's ends around a forced call: the tagged format opens it in the prompt. */
export function forcedCallFrame(format: ToolFormat): { prefix: string; suffix: string } {
  return format.kind === 'tagged'
    ? { prefix: `${format.open}\n`, suffix: `\n${format.close}` }
    : { prefix: '', suffix: '' };
}

/**
 * The JSON Schema of the call object a forced call (`tool_choice` 'required' or a named function) is decoded under:
 * the function's name as a constant and its `parameters` schema (any object where it has none) under the format's
 * arguments key; one of several such objects for 'required'.
 */
export function forcedCallSchema(
  format: ToolFormat,
  tools: readonly ChatTool[],
  choice: Exclude<ChatToolChoice, 'none' | 'auto'>,
): Record<string, unknown> {
  const chosen = choice === 'required' ? tools : tools.filter((t) => t.function.name === choice.function.name);
  if (chosen.length === 0) throw new RangeError(`forcedCallSchema: no tool named ${JSON.stringify(choice)}`);
  // Each function's definitions move to the root (its references still point there), under its own names.
  const defs: Record<string, unknown> = {};
  const callOf = (tool: ChatTool) => {
    const { $defs, definitions, ...parameters } = tool.function.parameters ?? {};
    const own = {
      ...(definitions as Record<string, unknown> | undefined),
      ...($defs as Record<string, unknown> | undefined),
    };
    const renamed = (name: string) => `${tool.function.name}.${name}`;
    for (const [name, schema] of Object.entries(own)) defs[renamed(name)] = retarget(schema, renamed);
    // Arguments are an object: a schema that does not say so gets it (`{}` would allow a string).
    const args = retarget({ type: 'object', ...parameters }, renamed);
    return {
      type: 'object',
      properties: { name: { const: tool.function.name }, [format.argumentsKey]: args },
      required: ['name', format.argumentsKey],
      additionalProperties: false,
    };
  };
  const calls = chosen.map(callOf);
  const call = calls.length === 1 ? calls[0] : { anyOf: calls };
  return Object.keys(defs).length > 0 ? { ...call, $defs: defs } : call;
}

/** `schema` with each local reference (`#/$defs/X`, `#/definitions/X`) pointing at `#/$defs/` + renamed(X). */
function retarget(schema: unknown, renamed: (name: string) => string): unknown {
  if (Array.isArray(schema)) return schema.map((s) => retarget(s, renamed));
  if (typeof schema !== 'object' || schema === null) return schema;
  return Object.fromEntries(
    Object.entries(schema).map(([key, value]) => {
      if (key === '$ref' && typeof value === 'string') {
        const local = /^#\/(?:\$defs|definitions)\/([^/]+)$/.exec(value);
        // JSON Pointer escapes '~' and '/' in a name as ~0 and ~1.
        const name = local?.[1].replaceAll('~1', '/').replaceAll('~0', '~');
        const escaped = name && renamed(name).replaceAll('~', '~0').replaceAll('/', '~1');
        return [key, escaped ? `#/$defs/${escaped}` : value];
      }
      return [key, retarget(value, renamed)];
    }),
  );
}

/** What a reader lets out as text arrives: content to show, and the calls it completed. */
export interface ToolReading {
  content: string;
  calls: ChatToolCall[];
}

/**
 * Reads a reply into content and tool calls as its text arrives (`push`, then `flush` at its end); a whole reply is
 * read the same way, so streamed and whole replies agree. Tagged format: text before a possible call tag streams at
 * once, a call is let out when its closing tag arrives, and a block that does not parse as a call of one of the
 * tools stays text. JSON format: a reply that starts with `{` or `[` is held to its end and read as a call (or an
 * array of calls); otherwise it streams as text. Whitespace next to a call, and at the reply's ends, is not content.
 */
export class ToolCallReader {
  private held = '';
  /** Whitespace after the last content let out, shown only when more content follows. */
  private space = '';
  private started = false;
  /** JSON format: the reply is held to its end (it opened as an object or array). */
  private holdAll = false;
  private decided = false;

  constructor(
    private readonly format: ToolFormat,
    private readonly tools: readonly ChatTool[],
    private readonly newCallId: () => string,
  ) {}

  push(text: string): ToolReading {
    this.held += text;
    const out: ToolReading = { content: '', calls: [] };
    if (this.format.kind === 'json') {
      if (!this.decided) {
        const first = this.held.trimStart();
        if (first.length === 0) return out;
        this.decided = true;
        this.holdAll = first.startsWith('{') || first.startsWith('[');
      }
      if (!this.holdAll) this.content(out, this.takeHeld());
      return out;
    }
    for (;;) {
      const open = this.held.indexOf(this.format.open);
      if (open < 0) {
        // Keep back a tail that may be the start of an opening tag.
        const keep = partialSuffix(this.held, this.format.open);
        this.content(out, this.held.slice(0, this.held.length - keep));
        this.held = this.held.slice(this.held.length - keep);
        return out;
      }
      const close = this.held.indexOf(this.format.close, open + this.format.open.length);
      if (close < 0) {
        this.content(out, this.held.slice(0, open));
        this.held = this.held.slice(open);
        return out;
      }
      // The call is what follows the last opening tag before the closing one: an opening tag mentioned in text
      // before it (a model reasoning about its tools) stays text.
      const start = this.held.lastIndexOf(this.format.open, close - this.format.open.length);
      this.content(out, this.held.slice(0, start));
      const block = this.held.slice(start, close + this.format.close.length);
      this.held = this.held.slice(close + this.format.close.length);
      const call = this.callOf(block.slice(this.format.open.length, block.length - this.format.close.length));
      if (call) {
        out.calls.push(call);
        this.space = '';
      } else this.content(out, block);
    }
  }

  /** The reply ended: what was held is read as it stands (an unclosed call is text). */
  flush(): ToolReading {
    const out: ToolReading = { content: '', calls: [] };
    const rest = this.takeHeld();
    if (this.format.kind === 'json' && this.holdAll) {
      const calls = this.callsOfJson(rest);
      if (calls) out.calls.push(...calls);
      else this.content(out, rest);
    } else this.content(out, rest);
    return out;
  }

  private takeHeld(): string {
    const text = this.held;
    this.held = '';
    return text;
  }

  /** Lets `text` out as content: no leading whitespace, trailing whitespace held until more content follows. */
  private content(out: ToolReading, text: string): void {
    if (text.length === 0) return;
    const body = text.trimEnd();
    const trailing = text.slice(body.length);
    if (body.length === 0) {
      if (this.started) this.space += trailing;
      return;
    }
    const lead = this.started ? this.space : '';
    out.content += lead + (this.started ? body : body.trimStart());
    this.started = true;
    this.space = trailing;
  }

  /** One tagged block's body as a call of one of the tools, or null. */
  private callOf(body: string): ChatToolCall | null {
    let value: unknown;
    try {
      value = JSON.parse(body);
    } catch {
      return null;
    }
    return this.call(value);
  }

  /** A JSON-format reply as its calls (one object, or an array of them), or null where any is not a call. */
  private callsOfJson(text: string): ChatToolCall[] | null {
    let value: unknown;
    try {
      value = JSON.parse(text);
    } catch {
      return null;
    }
    const items = Array.isArray(value) ? value : [value];
    if (items.length === 0) return null;
    const calls: ChatToolCall[] = [];
    for (const item of items) {
      const call = this.call(item);
      if (!call) return null;
      calls.push(call);
    }
    return calls;
  }

  private call(value: unknown): ChatToolCall | null {
    if (typeof value !== 'object' || value === null || Array.isArray(value)) return null;
    const { name } = value as { name?: unknown };
    const args =
      (value as Record<string, unknown>)[this.format.argumentsKey] ?? (value as { arguments?: unknown }).arguments;
    if (typeof name !== 'string' || !this.tools.some((t) => t.function.name === name)) return null;
    if (typeof args !== 'object' || args === null || Array.isArray(args)) return null;
    return { id: this.newCallId(), type: 'function', function: { name, arguments: JSON.stringify(args) } };
  }
}

/** The length of the longest proper prefix of `tag` that `text` ends with. */
function partialSuffix(text: string, tag: string): number {
  for (let n = Math.min(tag.length - 1, text.length); n > 0; n--) {
    if (text.endsWith(tag.slice(0, n))) return n;
  }
  return 0;
}
