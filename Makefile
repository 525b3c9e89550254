# Every target runs on the Node that package.json pins (the `node` npm package installs it into
# node_modules/.bin), not on whatever Node the machine has: only npm and make are needed.
export PATH := $(CURDIR)/node_modules/.bin:$(PATH)

.PHONY: run test test-faults bench typecheck install clean

## make run: the gateway on DATABASE_URL, or on an embedded Postgres under .data/ when unset
run: install
	npm start

## make test: type-check, then the test suite against real Postgres (embedded when DATABASE_URL is unset)
# Some tests hold 10,000 connections at once: the open-file limit is raised to what the system
# allows (many set a soft limit of 1,024 under a much higher hard one).
test: install typecheck
	ulimit -n "$$(ulimit -Hn)" 2>/dev/null || true; npm test

## make test-faults: only the fault suite (real processes killed, Postgres stopped, chaos upstream); part of make test too
test-faults: install
	ulimit -n "$$(ulimit -Hn)" 2>/dev/null || true; npm test -- test/faults

## make bench: the benchmark (a few minutes; DATABASE_URL's server, else an embedded Postgres); see BENCHMARKS.md
bench: install
	node bench/run.ts

typecheck: install
	npm run typecheck

install: node_modules/.installed

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund
	@touch $@

clean:
	rm -rf node_modules .tap dist
