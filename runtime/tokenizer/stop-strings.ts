/**
 * Stop strings over streamed text: text that might be the start of a stop string is held back until it either
 * completes one (generation ends; the stop string and anything after it are dropped) or turns out not to.
 */

export interface StopStringResult {
  /** Text that is safe to show now. */
  text: string;
  /** The stop string that completed, if one did; nothing more will be emitted. */
  stop?: string;
}

export class StopStringMatcher {
  private readonly stops: string[];
  private held = '';
  private stopped = false;

  constructor(stops: readonly string[]) {
    this.stops = [...new Set(stops.filter((s) => s.length > 0))];
  }

  get isStopped(): boolean {
    return this.stopped;
  }

  push(piece: string): StopStringResult {
    if (this.stopped) return { text: '' };
    const buffer = this.held + piece;
    let at = -1;
    let stop: string | undefined;
    for (const candidate of this.stops) {
      const index = buffer.indexOf(candidate);
      // Earliest match wins; at the same position the longer stop string (it contains the shorter one's start).
      if (index >= 0 && (at < 0 || index < at || (index === at && candidate.length > stop!.length))) {
        at = index;
        stop = candidate;
      }
    }
    if (stop !== undefined) {
      this.stopped = true;
      this.held = '';
      return { text: buffer.slice(0, at), stop };
    }
    const keep = this.longestPartialSuffix(buffer);
    this.held = buffer.slice(buffer.length - keep);
    return { text: buffer.slice(0, buffer.length - keep) };
  }

  /** The end of the stream: held text was not a stop string after all. */
  flush(): string {
    const text = this.stopped ? '' : this.held;
    this.held = '';
    return text;
  }

  /** Length of the longest suffix of `buffer` that is a proper prefix of some stop string. */
  private longestPartialSuffix(buffer: string): number {
    let best = 0;
    for (const stop of this.stops) {
      for (let n = Math.min(stop.length - 1, buffer.length); n > best; n--) {
        if (buffer.endsWith(stop.slice(0, n))) {
          best = n;
          break;
        }
      }
    }
    return best;
  }
}
