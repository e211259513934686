cp .xfer/p1 /tmp/xfer/ && ls -la /tmp/xfer /tmp/site | head
