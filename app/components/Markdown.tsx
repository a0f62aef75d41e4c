/**
 * Model output as Markdown (CommonMark + GFM tables, task lists and strikethrough through react-markdown and
 * remark-gfm; code highlighted by rehype-highlight), rendered to React elements only: raw HTML in the text is shown as
 * the text it is, never parsed (rawHtmlAsText), there is no dangerouslySetInnerHTML, and links are kept only for
 * http(s). Code blocks get a copy button.
 */
import { type ComponentProps, Fragment, type ReactNode, useRef, useState } from 'react';
import ReactMarkdown, { type Components } from 'react-markdown';
import rehypeHighlight from 'rehype-highlight';
import remarkGfm from 'remark-gfm';
import { CopyButton } from './CopyButton.tsx';

interface MarkdownNode {
  type: string;
  value?: string;
  children?: MarkdownNode[];
  position?: { start: { offset?: number } };
}

/** Raw HTML nodes (block or inline) become text nodes with the same characters, which React escapes. */
function rawHtmlAsText() {
  const visit = (node: MarkdownNode) => {
    node.children = node.children?.map((child) => {
      if (child.type === 'html') return { type: 'text', value: child.value ?? '' };
      visit(child);
      return child;
    });
  };
  return (tree: MarkdownNode) => visit(tree);
}

const SAFE_LINK = /^https?:\/\//i;

/** Links only to http(s) pages; any other target keeps its text and loses the link. */
function safeUrl(url: string): string {
  return SAFE_LINK.test(url) ? url : '';
}

function CodeBlock({ children }: { children?: ReactNode }) {
  const ref = useRef<HTMLPreElement>(null);
  const language = /language-([\w+-]+)/.exec(codeClassName(children) ?? '')?.[1] ?? '';
  return (
    <div className="code-block">
      <div className="code-head">
        <span className="code-lang">{language}</span>
        <CopyButton
          className="code-copy"
          testId="copy-code"
          text={() => (ref.current?.querySelector('code')?.textContent ?? '').replace(/\n$/, '')}
        />
      </div>
      <pre ref={ref} data-lang={language || undefined}>
        {children}
      </pre>
    </div>
  );
}

/** The class of a fenced block's <code> child ("hljs language-js"), where there is one. */
function codeClassName(children: ReactNode): string | undefined {
  const child = Array.isArray(children) ? children[0] : children;
  if (child && typeof child === 'object' && 'props' in child) {
    return (child.props as { className?: string }).className;
  }
  return undefined;
}

function SafeLink({ href, children }: ComponentProps<'a'>) {
  if (!href) return <span>{children}</span>;
  return (
    <a href={href} target="_blank" rel="noopener noreferrer nofollow">
      {children}
    </a>
  );
}

// Headings stay small inside a chat bubble: # is an h3.
const COMPONENTS: Components = {
  a: SafeLink,
  pre: CodeBlock,
  h1: ({ children }) => <h3>{children}</h3>,
  h2: ({ children }) => <h4>{children}</h4>,
  h3: ({ children }) => <h5>{children}</h5>,
  h4: ({ children }) => <h6>{children}</h6>,
  h5: ({ children }) => <h6>{children}</h6>,
  h6: ({ children }) => <h6>{children}</h6>,
  img: ({ alt }) => <span>{alt}</span>,
  table: ({ children }) => (
    <div className="table-scroll">
      <table>{children}</table>
    </div>
  ),
};

// One highlighter for every parse: rehype-highlight registers its languages each time its plugin is set up, which
// cost more than parsing a token's worth of text.
const highlighter = rehypeHighlight({ detect: false });
const highlightCode = () => highlighter;

/** What one parse learnt about its text's top-level blocks. */
interface BlockFindings {
  /** Where the last top-level block whose first line is complete starts (0: none but the first). */
  settledEnd: number;
  /** The text defines a link reference or a footnote, which other blocks may use. */
  defines: boolean;
}

function definesSomething(node: MarkdownNode): boolean {
  if (node.type === 'definition' || node.type === 'footnoteDefinition') return true;
  return node.children?.some(definesSomething) ?? false;
}

/**
 * Records where the top-level blocks start. Every block but the last is settled: text appended later cannot change
 * it, once the line that starts the next block is complete (that line alone decides what the next block is). Link
 * reference and footnote definitions are the exception, as they act on the whole text.
 */
function findBlocks(findings: BlockFindings) {
  return (tree: MarkdownNode, file: { value: unknown }) => {
    const text = String(file.value);
    const blocks = tree.children ?? [];
    findings.settledEnd = 0;
    for (let i = blocks.length - 1; i >= 1; i--) {
      const offset = blocks[i]!.position?.start.offset ?? 0;
      if (text.includes('\n', offset)) {
        findings.settledEnd = text.lastIndexOf('\n', offset - 1) + 1;
        break;
      }
    }
    findings.defines = definesSomething(tree);
  };
}

/**
 * micromark's inline parsing is quadratic in some runs of punctuation within one paragraph: each `]` walks back over
 * the paragraph looking for a footnote call's `[^` (a run of 16,000 `]` takes seconds), nested `[[[…]]]` compares
 * every label, and unmatched `*`, `_`, `~` delimiters are paired by rescans. Rule: a stretch of lines between blank
 * lines (outside code fences) in which one paragraph-like group of lines (a list item, heading or table row starts a
 * new group) holds more than PLAIN_RUN_MARKUP of the characters `[ ] * _ ~` is shown as plain text, never parsed.
 * Replies people read stay far below it; a model stuck repeating brackets does not.
 */
export const PLAIN_RUN_MARKUP = 400;
const MARKUP = /[[\]*_~]/g;
const GROUP_START = /^[ \t>]*(?:[-+*#|]|\d)/;
const FENCE = /^[ \t>]*(`{3,}|~{3,})/;
const BLANK = /^[ \t]*$/;

interface PlainRun {
  start: number;
  /** Where the blank line after it starts; null while the run is still open at the end of the text. */
  end: number | null;
}

function findPlainRun(text: string): PlainRun | null {
  let stretchStart = 0;
  let group = 0;
  let fence = '';
  let flagged = false;
  for (let lineStart = 0; lineStart <= text.length; ) {
    const newline = text.indexOf('\n', lineStart);
    const lineEnd = newline === -1 ? text.length : newline;
    const line = text.slice(lineStart, lineEnd);
    const next = lineEnd + 1;
    if (flagged) {
      if (newline !== -1 && BLANK.test(line)) return { start: stretchStart, end: lineStart };
    } else if (fence) {
      const close = FENCE.exec(line);
      if (
        close &&
        close[1]![0] === fence[0] &&
        close[1]!.length >= fence.length &&
        BLANK.test(line.slice(close[0].length))
      ) {
        fence = '';
        stretchStart = next;
        group = 0;
      }
    } else if (BLANK.test(line)) {
      stretchStart = next;
      group = 0;
    } else {
      const open = FENCE.exec(line);
      if (open) {
        fence = open[1]!;
      } else {
        if (GROUP_START.test(line)) group = 0;
        group += line.match(MARKUP)?.length ?? 0;
        flagged = group > PLAIN_RUN_MARKUP;
      }
    }
    if (newline === -1) break;
    lineStart = next;
  }
  return flagged ? { start: stretchStart, end: null } : null;
}

/** A piece of the text rendered on its own: settled pieces keep their element, so React skips them. */
interface Piece {
  start: number;
  node: ReactNode;
}

interface MarkdownTail extends Piece {
  kind: 'markdown';
  settledEnd: number;
}

/** An open plain run: scanned up to `scanned` for the blank line that ends it. */
interface PlainTail extends Piece {
  kind: 'plain';
  scanned: number;
  lineOnlySpaces: boolean;
  lineStart: number;
}

/**
 * A reply as it streams, rendered in pieces so each token costs the last open block, not the whole reply: the text
 * only grows, so the blocks a parse found settled are parsed once more on their own, kept, and the parse on the next
 * token starts after them. A text that is not the previous one plus more starts over; one that defines link
 * references or footnotes is parsed whole, as definitions reach across blocks. `parses` and `parsedChars` count the
 * parser's work, for tests.
 */
export class MarkdownStream {
  parses = 0;
  parsedChars = 0;
  private text = '';
  private settled: Piece[] = [];
  private tail: MarkdownTail | PlainTail | null = null;
  private whole = false;
  private output: ReactNode[] = [];

  update(text: string): ReactNode[] {
    if (text === this.text && this.tail) return this.output;
    if (!text.startsWith(this.text)) this.restart(false);
    this.text = text;
    this.advance();
    this.output = [...this.settled.map((piece) => piece.node), this.tail!.node];
    return this.output;
  }

  private restart(whole: boolean) {
    this.settled = [];
    this.tail = null;
    this.whole = whole;
  }

  private advance() {
    const text = this.text;
    let start = this.tail?.start ?? 0;
    for (;;) {
      const tail = this.tail;
      if (tail?.kind === 'plain') {
        const end = this.scanPlainTail(tail);
        if (end === null) {
          this.tail = { ...tail, node: this.plainNode(tail.start, text.slice(tail.start)) };
          return;
        }
        this.settle(this.plainNode(tail.start, text.slice(tail.start, end)), tail.start);
        start = end;
        this.tail = null;
        continue;
      }
      if (tail && tail.settledEnd > 0 && !this.whole) {
        if (!this.settleMarkdown(start, start + tail.settledEnd)) return this.redoWhole();
        start += tail.settledEnd;
      }
      const rest = text.slice(start);
      const run = findPlainRun(rest);
      if (run) {
        if (run.start > 0 && !this.settleMarkdown(start, start + run.start) && !this.whole) return this.redoWhole();
        const runStart = start + run.start;
        if (run.end !== null) {
          this.settle(this.plainNode(runStart, text.slice(runStart, start + run.end)), runStart);
          start += run.end;
          this.tail = null;
          continue;
        }
        const lastLine = text.lastIndexOf('\n') + 1;
        this.tail = {
          kind: 'plain',
          start: runStart,
          node: this.plainNode(runStart, text.slice(runStart)),
          scanned: text.length,
          lineStart: Math.max(lastLine, runStart),
          lineOnlySpaces: lastLine > runStart && BLANK.test(text.slice(lastLine)),
        };
        return;
      }
      const findings = { settledEnd: 0, defines: false };
      const node = this.markdownNode(start, rest, findings);
      if (findings.defines && !this.whole) return this.redoWhole();
      this.tail = { kind: 'markdown', start, node, settledEnd: findings.settledEnd };
      return;
    }
  }

  private redoWhole() {
    this.restart(true);
    this.advance();
  }

  /** Where the blank line that ends an open plain run starts, scanning only the text appended since last time. */
  private scanPlainTail(tail: PlainTail): number | null {
    const text = this.text;
    let { lineStart, lineOnlySpaces } = tail;
    for (let i = tail.scanned; i < text.length; i++) {
      const c = text.charCodeAt(i);
      if (c === 10) {
        if (lineOnlySpaces) return lineStart;
        lineStart = i + 1;
        lineOnlySpaces = true;
      } else if (c !== 32 && c !== 9) {
        lineOnlySpaces = false;
      }
    }
    tail.scanned = text.length;
    tail.lineStart = lineStart;
    tail.lineOnlySpaces = lineOnlySpaces;
    return null;
  }

  /** Parses text[start, end) as a settled piece; false when it defines something (the whole text is parsed then). */
  private settleMarkdown(start: number, end: number): boolean {
    const findings = { settledEnd: 0, defines: false };
    const node = this.markdownNode(start, this.text.slice(start, end), findings);
    this.settle(node, start);
    return !findings.defines;
  }

  private settle(node: ReactNode, start: number) {
    this.settled.push({ start, node });
  }

  /** Top-level blocks are separated by a newline in one parse's output; pieces keep that, so the HTML is the same. */
  private separator(start: number): string | null {
    return start > 0 && this.settled.length > 0 ? '\n' : null;
  }

  private markdownNode(start: number, text: string, findings: BlockFindings): ReactNode {
    this.parses++;
    this.parsedChars += text.length;
    const element = ReactMarkdown({
      children: text,
      remarkPlugins: [remarkGfm, rawHtmlAsText, [findBlocks, findings]],
      rehypePlugins: [highlightCode],
      urlTransform: safeUrl,
      components: COMPONENTS,
    });
    return (
      <Fragment key={start}>
        {this.separator(start)}
        {element}
      </Fragment>
    );
  }

  private plainNode(start: number, text: string): ReactNode {
    return (
      <Fragment key={start}>
        {this.separator(start)}
        <p style={{ whiteSpace: 'pre-wrap' }}>{text.replace(/\s+$/, '')}</p>
      </Fragment>
    );
  }
}

export function Markdown({ text }: { text: string }) {
  const [stream] = useState(() => new MarkdownStream());
  return <div className="markdown">{stream.update(text)}</div>;
}
