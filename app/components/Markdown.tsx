/**
 * Model output as Markdown (CommonMark + GFM tables, task lists and strikethrough through react-markdown and
 * remark-gfm; code highlighted by rehype-highlight), rendered to React elements only: raw HTML in the text is shown as
 * the text it is, never parsed (rawHtmlAsText), there is no dangerouslySetInnerHTML, and links are kept only for
 * http(s). Code blocks get a copy button.
 */
import { type ComponentProps, type ReactNode, useRef } from 'react';
import ReactMarkdown, { type Components } from 'react-markdown';
import rehypeHighlight from 'rehype-highlight';
import remarkGfm from 'remark-gfm';
import { CopyButton } from './CopyButton.tsx';

interface MarkdownNode {
  type: string;
  value?: string;
  children?: MarkdownNode[];
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

export function Markdown({ text }: { text: string }) {
  return (
    <div className="markdown">
      <ReactMarkdown
        remarkPlugins={[remarkGfm, rawHtmlAsText]}
        rehypePlugins={[[rehypeHighlight, { detect: false }]]}
        urlTransform={safeUrl}
        components={COMPONENTS}
      >
        {text}
      </ReactMarkdown>
    </div>
  );
}
