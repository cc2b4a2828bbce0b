package bigtable

import (
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// poller fetches what an operator and a dashboard fetch: the console's
// overview and dead letters every 2 s (an open tab), /metrics every 5 s (a
// Prometheus scrape).
type poller struct {
	addr       string
	deadLetter string

	mu       sync.Mutex
	closed   bool
	fetches  map[string]Fetches
	errs     []string
	dlShown  bool
	metShown bool
}

func newPoller(addr, deadLetter string) *poller {
	return &poller{addr: addr, deadLetter: deadLetter, fetches: map[string]Fetches{}}
}

type page struct {
	name  string
	path  string
	every time.Duration
	check func(p *poller, body string)
}

var pages = []page{
	{"console overview", "/ui/", 2 * time.Second, nil},
	{"console dead letters", "/ui/rows?state=failed", 2 * time.Second, func(p *poller, body string) {
		// The page links each row by its base64url work ID.
		if strings.Contains(body, base64.RawURLEncoding.EncodeToString([]byte(p.deadLetter))) {
			p.dlShown = true
		}
	}},
	{"/metrics", "/metrics", 5 * time.Second, func(p *poller, body string) {
		if strings.Contains(body, `outbox_relay_rows{state="failed"} 1`) {
			p.metShown = true
		}
	}},
}

func (p *poller) run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, pg := range pages {
		wg.Add(1)
		go func() {
			defer wg.Done()
			t := time.NewTicker(pg.every)
			defer t.Stop()
			for {
				p.fetch(ctx, pg)
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		}()
	}
	wg.Wait()
}

func (p *poller) fetch(ctx context.Context, pg page) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.addr+pg.path, nil)
	if err != nil {
		return
	}
	start := time.Now()
	resp, err := httpClient.Do(req)
	var body []byte
	if err == nil {
		body, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	ms := float64(time.Since(start)) / float64(time.Millisecond)
	if ctx.Err() != nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	switch {
	case err != nil:
		p.errs = append(p.errs, fmt.Sprintf("%s: %v", pg.path, err))
	case resp.StatusCode != http.StatusOK:
		p.errs = append(p.errs, fmt.Sprintf("%s: %s: %.200s", pg.path, resp.Status, body))
	case pg.check != nil:
		pg.check(p, string(body))
	}
	f := p.fetches[pg.name]
	f.N++
	f.SumMS += ms
	f.MaxMS = max(f.MaxMS, ms)
	p.fetches[pg.name] = f
}

// open starts counting: fetches before it are the warm-up's.
func (p *poller) open() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fetches, p.errs = map[string]Fetches{}, nil
}

// close stops counting.
func (p *poller) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
}

func (p *poller) result() (map[string]Fetches, []string, bool, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.fetches, p.errs, p.dlShown, p.metShown
}
